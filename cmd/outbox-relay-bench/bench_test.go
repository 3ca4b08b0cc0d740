package main

import (
	"bufio"
	"encoding/json"
	"math"
	"os"
	"strings"
	"testing"
	"time"
)

func TestPayloadSize(t *testing.T) {
	for _, i := range []int{0, 7, 12345, 999999999} {
		p := payload(i, 300)
		if len(p) != 300 {
			t.Errorf("payload(%d) is %d bytes, want 300", i, len(p))
		}
		var v struct {
			Pad string `json:"pad"`
			Seq int    `json:"seq"`
		}
		if err := json.Unmarshal([]byte(p), &v); err != nil || v.Seq != i {
			t.Errorf("payload(%d) = %s: %v", i, p, err)
		}
	}
}

func TestPercentile(t *testing.T) {
	v := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for _, c := range []struct{ p, want float64 }{{0.5, 5}, {0.99, 10}, {0.1, 1}, {1, 10}} {
		if got := percentile(v, c.p); got != c.want {
			t.Errorf("percentile(%v) = %v, want %v", c.p, got, c.want)
		}
	}
	if !math.IsNaN(percentile(nil, 0.5)) {
		t.Error("percentile of nothing is not NaN")
	}
}

func TestTrackerIndex(t *testing.T) {
	tr := newTracker("st-", 10)
	tr.hook.record(tr, "st-3", 5)
	tr.hook.record(tr, "st-3", 6)
	tr.hook.record(tr, "other-3", 7)
	tr.hook.record(tr, "st-10", 8)
	if tr.hook.unique.Load() != 1 || tr.hook.repeats.Load() != 1 || tr.hook.at[3].Load() != 5 {
		t.Errorf("unique %d repeats %d at %d", tr.hook.unique.Load(), tr.hook.repeats.Load(), tr.hook.at[3].Load())
	}
}

func TestThousands(t *testing.T) {
	for n, want := range map[int]string{0: "0", 999: "999", 1000: "1,000", 1234567: "1,234,567", -4500: "-4,500"} {
		if got := thousands(n); got != want {
			t.Errorf("thousands(%d) = %q, want %q", n, got, want)
		}
	}
}

func TestReadProcTimesSelf(t *testing.T) {
	s, err := takeSnapshot()
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("no /proc under CI: %v", err)
		}
		t.Skipf("no /proc (not Linux?; under CI this fails above): %v", err)
	}
	if s.total <= 0 || len(s.procs) == 0 {
		t.Fatalf("empty snapshot: %+v", s.total)
	}
}

func TestParseHistogram(t *testing.T) {
	text := `# HELP outbox_relay_decode_latency_seconds x
outbox_relay_decode_latency_seconds_bucket{le="0.005"} 90
outbox_relay_decode_latency_seconds_bucket{le="0.01"} 97
outbox_relay_decode_latency_seconds_bucket{le="+Inf"} 100
outbox_relay_decode_latency_seconds_sum 1.5
outbox_relay_other_bucket{le="0.01"} 5
`
	h, err := parseHistogram(bufio.NewScanner(strings.NewReader(text)), "outbox_relay_decode_latency_seconds")
	if err != nil {
		t.Fatal(err)
	}
	earlier := histogram{0.005: 40, 0.01: 47, inf: 48}
	over, total := h.since(earlier).over(0.01)
	if over != 2 || total != 52 {
		t.Fatalf("over 10 ms %v of %v, want 2 of 52", over, total)
	}
}

// TestTailSourcesComparesTheFloorsWalsender: the tail row counts the floor
// client's walsender's late transactions beside the relay's, against the
// same 10 ms and 25 ms bounds.
func TestTailSourcesComparesTheFloorsWalsender(t *testing.T) {
	var floor sendLag
	for _, ms := range []int{1, 9, 10, 11, 24, 26, 40} {
		floor.observe(time.Duration(ms) * time.Millisecond)
	}
	sent := histogram{0.01: 90, 0.025: 97, inf: 100}
	decoded := histogram{0.01: 80, 0.025: 95, inf: 100}
	got := tailSources(sent, decoded, []float64{1, 12, 30}, &floor)
	for _, want := range []string{"its send time): 10 / 3 of 100", "before any sink): 20 / 5 of 100", "at NATS: 2 / 1 of 3",
		"the floor client's walsender, for comparison: 4 / 2 of 7"} {
		if !strings.Contains(got, want) {
			t.Errorf("tail sources %q lack %q", got, want)
		}
	}
}
