package main

import (
	"fmt"
	"runtime/debug"
	"strings"

	"github.com/spf13/cobra"
)

// version is set at build time with -ldflags "-X main.version=…": the
// container image sets its release, `make build` the output of git
// describe (which works in a git worktree too, where the go command does not
// stamp the commit). Otherwise the module's build information says which
// build this is (versionString).
var version = "dev"

// versionString says which build this is (describeBuild).
func versionString() string {
	info, _ := debug.ReadBuildInfo()
	return describeBuild(version, info)
}

// describeBuild says which build this is: the version set at build time,
// else the module's version (go install …@v1.2.3), else "dev"; followed by
// what the build information holds: the commit the go command stamped (a
// build inside a git checkout), its time, whether the tree had uncommitted
// changes, and the Go release. info may be nil.
func describeBuild(version string, info *debug.BuildInfo) string {
	v := version
	if info == nil {
		return v
	}
	if v == "dev" && info.Main.Version != "" && info.Main.Version != "(devel)" {
		v = info.Main.Version
	}
	var revision, at string
	modified := false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			revision = s.Value
		case "vcs.time":
			at = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	var parts []string
	if revision != "" && !strings.Contains(v, revision[:min(7, len(revision))]) {
		parts = append(parts, "commit "+revision[:min(12, len(revision))])
	}
	if at != "" {
		parts = append(parts, at)
	}
	if modified {
		parts = append(parts, "with uncommitted changes")
	}
	if info.GoVersion != "" {
		parts = append(parts, info.GoVersion)
	}
	if len(parts) == 0 {
		return v
	}
	return v + " (" + strings.Join(parts, ", ") + ")"
}

func newVersionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version, the commit it was built from and the Go release",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, err := fmt.Fprintf(cmd.OutOrStdout(), "outbox-relay version %s\n", versionString())
			return err
		},
	}
}
