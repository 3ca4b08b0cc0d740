package relay_test

import (
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestPolicy_Decide: the pairs' outcomes decide the event: a failure
// beats a held pair, which beats a counted retry, which beats a deferred
// pair; a retry reaching max_attempts is a dead letter; the most Counted of
// the pairs is added to the row's attempts; a retry waits for the backoff,
// Retry-After or a deferred pair's time, whichever is latest.
func TestPolicy_Decide(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	delivered := relay.Outcome{Kind: relay.Delivered}
	failed := relay.Outcome{Kind: relay.Failed, Reason: "400 bad", Counted: 1}
	held := relay.Outcome{Kind: relay.Held, Reason: "outcome unknown: timeout", Unknown: true, Counted: 1}
	retry := func(counted int, until time.Time) relay.Outcome {
		return relay.Outcome{Kind: relay.Retry, Reason: "503", Counted: counted, Until: until}
	}
	deferred := func(until time.Time, why string) relay.Outcome {
		return relay.Outcome{Kind: relay.Deferred, Reason: "circuit open", Until: until, Why: why}
	}
	policy := relay.Policy{MaxAttempts: 5, Backoff: []time.Duration{10 * time.Second, time.Minute}}

	tests := []struct {
		name     string
		attempts int
		outcomes []relay.Outcome
		want     relay.Decision
		// atFrom and atTo bound Decision.At when want.Kind is Later.
		atFrom, atTo time.Time
		reason       []string // substrings of Decision.Reason
		notReason    []string
	}{
		{name: "all delivered is done", attempts: 2, outcomes: []relay.Outcome{delivered, delivered},
			want: relay.Decision{Kind: relay.Done, Attempts: 2}},
		{name: "no pairs is done", want: relay.Decision{Kind: relay.Done}},
		{name: "failed beats held, retry and deferred", attempts: 1,
			outcomes: []relay.Outcome{deferred(now.Add(time.Hour), "sink_down"), retry(2, time.Time{}), held, failed},
			want:     relay.Decision{Kind: relay.DeadLetter, Attempts: 3},
			reason:   []string{"sink d: 400 bad"}, notReason: []string{"503", "circuit", "timeout"}},
		{name: "held beats retry and deferred", outcomes: []relay.Outcome{retry(1, time.Time{}), deferred(now, "ordering"), held, delivered},
			want:   relay.Decision{Kind: relay.Hold, Attempts: 1},
			reason: []string{"sink c: outcome unknown"}, notReason: []string{"503"}},
		{name: "retry beats deferred, waits for the backoff", attempts: 1,
			outcomes: []relay.Outcome{retry(1, time.Time{}), deferred(now.Add(time.Second), "sink_down")},
			want:     relay.Decision{Kind: relay.Later, Attempts: 2, Why: "retries"},
			atFrom:   now.Add(time.Minute), atTo: now.Add(time.Minute + 6*time.Second),
			reason: []string{"sink a: 503", "sink b: circuit open"}},
		{name: "retry waits for Retry-After when it is later than the backoff",
			outcomes: []relay.Outcome{retry(1, now.Add(time.Hour))},
			want:     relay.Decision{Kind: relay.Later, Attempts: 1, Why: "retries"},
			atFrom:   now.Add(time.Hour), atTo: now.Add(time.Hour)},
		{name: "retry waits for a deferred pair's time when it is later",
			outcomes: []relay.Outcome{retry(1, time.Time{}), deferred(now.Add(2*time.Hour), "sink_down")},
			want:     relay.Decision{Kind: relay.Later, Attempts: 1, Why: "retries"},
			atFrom:   now.Add(2 * time.Hour), atTo: now.Add(2 * time.Hour)},
		{name: "deferred only counts nothing and waits until its time", attempts: 4,
			outcomes: []relay.Outcome{delivered, deferred(now.Add(30*time.Second), "sink_down"), deferred(now.Add(time.Minute), "ordering")},
			want:     relay.Decision{Kind: relay.Later, Attempts: 4, Why: "sink_down"},
			atFrom:   now.Add(time.Minute), atTo: now.Add(time.Minute)},
		{name: "deferred in the past is due now", outcomes: []relay.Outcome{deferred(now.Add(-time.Hour), "ordering")},
			want:   relay.Decision{Kind: relay.Later, Why: "ordering"},
			atFrom: now, atTo: now},
		{name: "max_attempts reached is a dead letter", attempts: 3, outcomes: []relay.Outcome{retry(2, time.Time{})},
			want: relay.Decision{Kind: relay.DeadLetter, Attempts: 5}, reason: []string{"max_attempts reached", "503"}},
		{name: "one short of max_attempts retries", attempts: 3, outcomes: []relay.Outcome{retry(1, time.Time{})},
			want:   relay.Decision{Kind: relay.Later, Attempts: 4, Why: "retries"},
			atFrom: now.Add(time.Minute), atTo: now.Add(time.Minute + 6*time.Second)},
		{name: "counted adds the most of the pairs, not the sum", attempts: 1,
			outcomes: []relay.Outcome{retry(2, time.Time{}), retry(3, time.Time{}), retry(1, time.Time{})},
			want:     relay.Decision{Kind: relay.Later, Attempts: 4, Why: "retries"}, // 1+2+3+1 would be a dead letter
			atFrom:   now.Add(time.Minute), atTo: now.Add(time.Minute + 6*time.Second)},
		{name: "counted of a failed pair is added", attempts: 2, outcomes: []relay.Outcome{failed, retry(1, time.Time{})},
			want: relay.Decision{Kind: relay.DeadLetter, Attempts: 3}},
		{name: "the first attempt backs off by the first entry",
			outcomes: []relay.Outcome{retry(1, time.Time{})},
			want:     relay.Decision{Kind: relay.Later, Attempts: 1, Why: "retries"},
			atFrom:   now.Add(10 * time.Second), atTo: now.Add(11 * time.Second)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sinks := []string{"a", "b", "c", "d"}[:len(tt.outcomes)]
			got := policy.Decide(now, tt.attempts, tt.outcomes, sinks)
			if got.Kind != tt.want.Kind || got.Attempts != tt.want.Attempts || got.Why != tt.want.Why {
				t.Fatalf("decision %+v, want kind %d, attempts %d, why %q", got, tt.want.Kind, tt.want.Attempts, tt.want.Why)
			}
			if got.Kind == relay.Later && (got.At.Before(tt.atFrom) || got.At.After(tt.atTo)) {
				t.Fatalf("At is %v after now, want %v to %v", got.At.Sub(now), tt.atFrom.Sub(now), tt.atTo.Sub(now))
			}
			if got.Kind != relay.Later && !got.At.IsZero() {
				t.Fatalf("At %v set on a %d decision", got.At, got.Kind)
			}
			for _, s := range tt.reason {
				if !strings.Contains(got.Reason, s) {
					t.Errorf("reason %q does not say %q", got.Reason, s)
				}
			}
			for _, s := range tt.notReason {
				if strings.Contains(got.Reason, s) {
					t.Errorf("reason %q says %q", got.Reason, s)
				}
			}
			if got.Kind == relay.Done && got.Reason != "" {
				t.Errorf("done with reason %q", got.Reason)
			}
		})
	}
}

// TestPolicy_DecideReasonIsStorable: the joined reasons of many failing
// sinks stay within what the database stores.
func TestPolicy_DecideReasonIsStorable(t *testing.T) {
	long := strings.Repeat("é", 300)
	outcomes := []relay.Outcome{{Kind: relay.Failed, Reason: long}, {Kind: relay.Failed, Reason: long}, {Kind: relay.Failed, Reason: long}}
	d := relay.Policy{}.Decide(time.Now(), 0, outcomes, []string{"a", "b", "c"})
	if len(d.Reason) > 500 || !utf8.ValidString(d.Reason) {
		t.Fatalf("reason of %d bytes, valid UTF-8 %v", len(d.Reason), utf8.ValidString(d.Reason))
	}
}

// TestPolicy_BackoffAfterJitter: the delay after n attempts is the n-th
// backoff entry (the last repeats; none before the first) plus 0–10%.
func TestPolicy_BackoffAfterJitter(t *testing.T) {
	custom := relay.Policy{Backoff: []time.Duration{time.Second, 20 * time.Second}}
	var zero relay.Policy // takes DefaultBackoff
	def := relay.DefaultBackoff()
	for _, tt := range []struct {
		name     string
		p        *relay.Policy
		attempts int
		base     time.Duration
	}{
		{"no attempts yet", &custom, 0, time.Second},
		{"first", &custom, 1, time.Second},
		{"second", &custom, 2, 20 * time.Second},
		{"past the end repeats the last", &custom, 9, 20 * time.Second},
		{"default first", &zero, 1, def[0]},
		{"default last", &zero, 100, def[len(def)-1]},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var lowest, highest time.Duration = 1 << 62, 0
			for range 2000 {
				d := tt.p.BackoffAfter(tt.attempts)
				lowest, highest = min(lowest, d), max(highest, d)
				if d < tt.base || d > tt.base+tt.base/10 {
					t.Fatalf("BackoffAfter(%d) = %v, want %v to %v", tt.attempts, d, tt.base, tt.base+tt.base/10)
				}
			}
			if highest-lowest < tt.base/20 {
				t.Fatalf("2000 delays span %v to %v: no jitter", lowest, highest)
			}
		})
	}
}

// TestRetryDelay: the relay's own retries wait 100 ms doubling to 6.4 s,
// plus up to 25%.
func TestRetryDelay(t *testing.T) {
	for attempt, base := range map[int]time.Duration{
		0: 100 * time.Millisecond, 1: 100 * time.Millisecond, 2: 200 * time.Millisecond,
		4: 800 * time.Millisecond, 7: 6400 * time.Millisecond, 50: 6400 * time.Millisecond,
	} {
		for range 1000 {
			if d := relay.RetryDelay(attempt); d < base || d > base+base/4 {
				t.Fatalf("RetryDelay(%d) = %v, want %v to %v", attempt, d, base, base+base/4)
			}
		}
	}
}

func TestShortError(t *testing.T) {
	for _, tt := range []struct{ name, in, want string }{
		{"plain", "503 Service Unavailable", "503 Service Unavailable"},
		{"first line only", "first\nsecond", "first"},
		{"carriage return ends the line", "first\r\nsecond", "first"},
		{"empty first line", "\nsecond", ""},
		{"NUL dropped", "a\x00b\x00", "ab"},
		{"invalid UTF-8 replaced", "bad \xff\xfe byte", "bad \uFFFD byte"},
		{"500 bytes kept", strings.Repeat("x", 500), strings.Repeat("x", 500)},
		{"cut at 500 bytes", strings.Repeat("x", 501), strings.Repeat("x", 500)},
		{"cut at a character boundary", "x" + strings.Repeat("é", 250), "x" + strings.Repeat("é", 249)},
		{"replacement counted in the cut", strings.Repeat("\xffa", 200), strings.Repeat("\uFFFDa", 125)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := relay.ShortError(tt.in); got != tt.want {
				t.Fatalf("ShortError(%q) = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
}

// FuzzShortError: whatever the bytes, the text is storable in PostgreSQL
// (valid UTF-8, no NUL), at most 500 bytes, one line, and ShortError leaves
// it as it is.
func FuzzShortError(f *testing.F) {
	for _, s := range []string{"", "plain", "a\nb", "\r", "\x00", "\xff", strings.Repeat("€", 200), "é\xc3"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := relay.ShortError(s)
		if !utf8.ValidString(got) {
			t.Fatalf("ShortError(%q) = %q: invalid UTF-8", s, got)
		}
		if strings.IndexByte(got, 0) >= 0 {
			t.Fatalf("ShortError(%q) = %q holds a NUL byte", s, got)
		}
		if len(got) > 500 {
			t.Fatalf("ShortError(%q) is %d bytes", s, len(got))
		}
		if strings.ContainsAny(got, "\r\n") {
			t.Fatalf("ShortError(%q) = %q holds a line break", s, got)
		}
		if again := relay.ShortError(got); again != got {
			t.Fatalf("ShortError is not idempotent: %q, then %q", got, again)
		}
		first, _, _ := strings.Cut(strings.ReplaceAll(s, "\r", "\n"), "\n")
		if utf8.ValidString(first) && !strings.Contains(first, "\x00") && len(first) <= 500 && got != first {
			t.Fatalf("ShortError(%q) = %q, want the first line %q untouched", s, got, first)
		}
	})
}

func TestMatches(t *testing.T) {
	for _, tt := range []struct {
		name      string
		globs     []string
		eventType *string
		want      bool
	}{
		{"no globs take everything", nil, str("a.b"), true},
		{"no globs take NULL", nil, nil, true},
		{"star takes NULL", []string{"*"}, nil, true},
		{"star takes any type", []string{"*"}, str("lead.created"), true},
		{"prefix glob", []string{"order.*"}, str("order.placed"), true},
		{"prefix glob misses", []string{"order.*"}, str("lead.created"), false},
		{"glob never matches NULL", []string{"order.*"}, nil, false},
		{"star alone takes a type with a slash", []string{"*"}, str("a/b"), true},
		{"path star stops at slash", []string{"a*"}, str("a/b"), false},
		{"any of several", []string{"lead.*", "order.placed"}, str("order.placed"), true},
		{"exact miss", []string{"order.placed"}, str("order.placed2"), false},
		{"character class", []string{"order.[ps]*"}, str("order.shipped"), true},
		{"empty type", []string{"order.*"}, str(""), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := relay.Matches(tt.globs, tt.eventType); got != tt.want {
				t.Fatalf("Matches(%q, %v) = %v, want %v", tt.globs, tt.eventType, got, tt.want)
			}
		})
	}
}
