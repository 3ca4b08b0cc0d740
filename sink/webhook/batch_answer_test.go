package webhook_test

import (
	"bytes"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// outcome is what a test expects for one event of a batch.
type outcome struct {
	delivered bool
	class     relay.ErrorClass
	contains  string // in the error's text
}

var (
	delivered = outcome{delivered: true}
	unknown   = func(contains string) outcome { return outcome{class: relay.Unknown, contains: contains} }
)

// checkOutcomes compares each event's outcome, in the batch's order, with
// want.
func checkOutcomes(t *testing.T, errs []error, want []outcome) {
	t.Helper()
	if len(errs) != len(want) {
		t.Fatalf("%d outcomes, want %d", len(errs), len(want))
	}
	for i, w := range want {
		err := errs[i]
		if w.delivered {
			if err != nil {
				t.Errorf("evt-%d: %v, want delivered", i+1, err)
			}
			continue
		}
		if class, _ := relay.Classify(err); err == nil || class != w.class || !strings.Contains(err.Error(), w.contains) {
			t.Errorf("evt-%d: %v, want %v containing %q", i+1, err, w.class, w.contains)
		}
	}
}

// answerForm is one of the two shapes of a results answer.
var answerForms = []struct{ name, open, close string }{
	{"results", `{"results":[`, `]}`},
	{"bare array", `[`, `]`},
}

// batchAnswering returns a batching sink for n events whose receiver
// answers every request 200 with answer; its log goes to logs when that is
// not nil.
func batchAnswering(t *testing.T, n int, answer string, logs *logBuffer) *webhook.Sink {
	t.Helper()
	rc := MustReceiver(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte(answer)) })
	cfg := webhook.Config{URL: rc.URL, Batch: webhook.Batch{MaxEvents: n, MaxWait: time.Second}}
	if logs != nil {
		cfg.Logger = zerolog.New(logs)
	}
	return MustSink(t, cfg)
}

// logBuffer collects a sink's log lines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// TestBatch_MalformedEntryIsUnknownForItsEventOnly: an entry of a results
// answer that cannot be read leaves only its own event's outcome unknown
// (on_unknown decides); the entries beside it settle their events. An
// entry without a readable id names no event, so the event it was meant
// for is not listed.
func TestBatch_MalformedEntryIsUnknownForItsEventOnly(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, entry, contains string }{
		{"empty result", `{"id":"evt-4","result":""}`, "malformed"},
		{"no result", `{"id":"evt-4","message":"done"}`, "malformed"},
		{"result not a string", `{"id":"evt-4","result":true}`, "malformed"},
		{"empty id", `{"id":"","result":"ok"}`, "do not list it"},
		{"no id", `{"result":"ok"}`, "do not list it"},
		{"id not a string", `{"id":4,"result":"ok"}`, "do not list it"},
		{"not an object", `"evt-4"`, "do not list it"},
	} {
		for _, form := range answerForms {
			t.Run(tc.name+"/"+form.name, func(t *testing.T) {
				t.Parallel()
				answer := form.open + `{"id":"evt-1","result":"ok"},{"id":"evt-2","result":"retry","message":"busy"},` +
					`{"id":"evt-3","result":"fail","message":"bad address"},` + tc.entry + form.close
				s := batchAnswering(t, 4, answer, nil)
				checkOutcomes(t, sendInOrder(t, s, deliveries(4)), []outcome{
					delivered,
					{class: relay.Transient, contains: "busy"},
					{class: relay.Permanent, contains: "bad address"},
					unknown(tc.contains),
				})
			})
		}
	}
}

// TestBatch_IDNotInTheBatchIsIgnored: an entry naming an id the batch does
// not carry settles nothing and is logged; the other entries apply.
func TestBatch_IDNotInTheBatchIsIgnored(t *testing.T) {
	t.Parallel()
	for _, form := range answerForms {
		t.Run(form.name, func(t *testing.T) {
			t.Parallel()
			answer := form.open + `{"id":"evt-1","result":"ok"},{"id":"evt-9","result":"fail","message":"not yours"},` +
				`{"id":"evt-2","result":"retry","message":"busy"},{"id":"evt-3","result":"fail","message":"bad address"}` + form.close
			logs := &logBuffer{}
			s := batchAnswering(t, 3, answer, logs)
			checkOutcomes(t, sendInOrder(t, s, deliveries(3)), []outcome{
				delivered,
				{class: relay.Transient, contains: "busy"},
				{class: relay.Permanent, contains: "bad address"},
			})
			if !strings.Contains(logs.String(), `evt-9`) {
				t.Errorf("the log does not name the id evt-9 the batch did not carry:\n%s", logs)
			}
		})
	}
}

// TestBatch_IDAnsweredTwice: an id answered twice with different results
// (a malformed entry counts as one) is unknown, whichever comes first;
// twice with the same result is that result.
func TestBatch_IDAnsweredTwice(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		entries string
		want    []outcome
	}{
		{"well-formed", `{"id":"evt-1","result":"ok"},{"id":"evt-1","result":"fail","message":"no"},` +
			`{"id":"evt-2","result":"fail","message":"no"},{"id":"evt-2","result":"ok"},` +
			`{"id":"evt-3","result":"retry","message":"busy"},{"id":"evt-3","result":"retry","message":"still busy"},` +
			`{"id":"evt-4","result":"ok"},{"id":"evt-4","result":"ok","message":"again"}`,
			[]outcome{unknown("twice"), unknown("twice"), {class: relay.Transient, contains: "busy"}, delivered}},
		{"one malformed", `{"id":"evt-1","result":"ok"},{"id":"evt-1","result":""},` +
			`{"id":"evt-2","result":"retry","message":"busy"}`,
			[]outcome{unknown("twice"), {class: relay.Transient, contains: "busy"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := batchAnswering(t, len(tc.want), `{"results":[`+tc.entries+`]}`, nil)
			checkOutcomes(t, sendInOrder(t, s, deliveries(len(tc.want))), tc.want)
		})
	}
}

// TestBatch_AnswerOverTheReadLimitIsUnknown: a 2xx answer too large to read
// whole cannot say which events the receiver applied: every event of the
// batch is unknown, none delivered.
func TestBatch_AnswerOverTheReadLimitIsUnknown(t *testing.T) {
	t.Parallel()
	results := `"results":[{"id":"evt-1","result":"ok"},{"id":"evt-2","result":"retry"},{"id":"evt-3","result":"fail"}]`
	padding := `"padding":"` + strings.Repeat("x", 5<<20) + `"`
	for _, tc := range []struct{ name, answer string }{
		{"results first", "{" + results + "," + padding + "}"},
		{"results last", "{" + padding + "," + results + "}"},
		{"no results", "[" + strings.Repeat(`{"result":"applied"},`, 300_000) + "{}]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := batchAnswering(t, 3, tc.answer, nil)
			checkOutcomes(t, sendInOrder(t, s, deliveries(3)), []outcome{
				unknown("larger than"), unknown("larger than"), unknown("larger than"),
			})
		})
	}
}
