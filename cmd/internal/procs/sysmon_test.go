package procs

import (
	"slices"
	"testing"
)

func TestWithSysmonSetting(t *testing.T) {
	for _, c := range []struct {
		name    string
		env     []string
		want    []string
		changed bool
	}{
		{"no GODEBUG", []string{"A=1"}, []string{"A=1", "GODEBUG=" + SysmonSetting}, true},
		{"an empty GODEBUG", []string{"GODEBUG=", "A=1"}, []string{"GODEBUG=" + SysmonSetting, "A=1"}, true},
		{"other settings kept, in front", []string{"GODEBUG=gctrace=1,madvdontneed=1"}, []string{"GODEBUG=gctrace=1,madvdontneed=1," + SysmonSetting}, true},
		{"the operator's schedtrace stands", []string{"GODEBUG=schedtrace=0", "A=1"}, []string{"GODEBUG=schedtrace=0", "A=1"}, false},
		{"the operator's schedtrace among others", []string{"GODEBUG=gctrace=1,schedtrace=1000"}, []string{"GODEBUG=gctrace=1,schedtrace=1000"}, false},
		{"a key the runtime does not read is not the operator's schedtrace", []string{"GODEBUG=gctrace=1, schedtrace=0"}, []string{"GODEBUG=gctrace=1, schedtrace=0," + SysmonSetting}, true},
		{"a later duplicate dropped (the runtime reads the first)", []string{"GODEBUG=gctrace=1", "GODEBUG=x=2"}, []string{"GODEBUG=gctrace=1," + SysmonSetting}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, changed := WithSysmonSetting(slices.Clone(c.env))
			if changed != c.changed || !slices.Equal(got, c.want) {
				t.Errorf("WithSysmonSetting(%q) = %q, %v; want %q, %v", c.env, got, changed, c.want, c.changed)
			}
		})
	}
}
