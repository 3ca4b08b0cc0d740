package notify_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay/notify"
)

// mustNotifier returns a notifier on store and sender over the sinks n8n and
// nats; cfg's other fields are kept.
func mustNotifier(tb testing.TB, store notify.Store, sender notify.Sender, cfg notify.Config) *notify.Notifier {
	tb.Helper()
	cfg.Store, cfg.Sender = store, sender
	if cfg.Sinks == nil {
		cfg.Sinks = []string{"n8n", "nats"}
	}
	cfg.Logger = zerolog.New(zerolog.NewTestWriter(tb))
	n, err := notify.New(cfg)
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	return n
}

func mustPass(tb testing.TB, n *notify.Notifier) {
	tb.Helper()
	if err := n.RunPass(context.Background()); err != nil {
		tb.Fatalf("pass: %v", err)
	}
}

// TestNotifier_OneSummaryPerSink: each sink a dead letter's last_error names
// gets it counted, a dead letter that names none (or a sink no longer
// configured) goes to "*", and each channel gets one summary with the first
// five events, the newest error and its window.
func TestNotifier_OneSummaryPerSink(t *testing.T) {
	store, sender := newMemStore(), &memSender{}
	n8n := store.add(3, "failed", "sink n8n: receiver answered 400")
	nats := store.add(2, "held", "sink nats: outcome unknown: no ack")
	both := store.add(1, "failed", "sink n8n: 422; sink nats: message too large")
	none := store.add(1, "failed", "event_key is 9000 bytes; the ledger holds at most 2048")
	old := store.add(1, "failed", "sink old: 400")
	mustPass(t, mustNotifier(t, store, sender, notify.Config{}))

	last := notify.Mark{At: store.rows[len(store.rows)-1].At, ID: old[0]}
	for _, c := range []struct {
		sink                string
		count, failed, held int
		ids                 []int64
		lastError           string
	}{
		{"n8n", 4, 4, 0, append(n8n, both...), "sink n8n: 422; sink nats: message too large"},
		{"nats", 3, 1, 2, append(nats, both...), "sink n8n: 422; sink nats: message too large"},
		{notify.AnySink, 2, 2, 0, append(none, old...), "sink old: 400"},
	} {
		got := sender.bySink(c.sink)
		if len(got) != 1 {
			t.Fatalf("%s: %d summaries, want 1", c.sink, len(got))
		}
		s := got[0]
		var ids []int64
		for _, e := range s.Events {
			ids = append(ids, e.ID)
		}
		if s.Count != c.count || s.Failed != c.failed || s.Held != c.held || !slices.Equal(ids, c.ids) || s.LastError != c.lastError {
			t.Errorf("%s: %+v, want count %d (%d failed, %d held), events %v, last error %q", c.sink, s, c.count, c.failed, c.held, c.ids, c.lastError)
		}
		if s.From != (notify.Mark{}) || s.To != last || s.More {
			t.Errorf("%s: window %v..%v more=%v, want ..%v", c.sink, s.From, s.To, s.More, last)
		}
		if store.marks[c.sink] != last {
			t.Errorf("%s: mark %v, want %v", c.sink, store.marks[c.sink], last)
		}
	}

	// Nothing new: nothing sent.
	mustPass(t, mustNotifier(t, store, sender, notify.Config{}))
	if len(sender.sent) != 3 {
		t.Errorf("%d summaries after a pass with nothing new, want 3", len(sender.sent))
	}
}

// TestNotifier_FirstFive: a summary names the first five events and the
// newest error.
func TestNotifier_FirstFive(t *testing.T) {
	store, sender := newMemStore(), &memSender{}
	ids := store.add(11, "failed", "sink n8n: 400")
	store.add(1, "failed", "sink n8n: 413 too large")
	mustPass(t, mustNotifier(t, store, sender, notify.Config{}))
	s := sender.bySink("n8n")[0]
	if s.Count != 12 || len(s.Events) != notify.FirstEvents || s.Events[0].ID != ids[0] || s.Events[4].ID != ids[4] || s.LastError != "sink n8n: 413 too large" {
		t.Errorf("summary %+v, want 12 counted, the first 5 named, the newest error", s)
	}
}

// TestNotifier_ChosenSinks: only the channels configured are notified
// about; the others' dead letters do not reach them.
func TestNotifier_ChosenSinks(t *testing.T) {
	store, sender := newMemStore(), &memSender{}
	store.add(2, "failed", "sink nats: 400")
	store.add(1, "failed", "no sink")
	store.add(1, "failed", "sink n8n: 400")
	mustPass(t, mustNotifier(t, store, sender, notify.Config{Channels: []string{"n8n"}}))
	if len(sender.sent) != 1 || sender.sent[0].Sink != "n8n" || sender.sent[0].Count != 1 {
		t.Errorf("sent %+v, want one summary of n8n's one dead letter", sender.sent)
	}
}

// TestNotifier_NotAcceptedIsSentAgainWithWhatAccumulated: a summary the
// receiver did not accept leaves the mark where it was; the next pass sends
// the dead letters since then, old and new, and moves the mark.
func TestNotifier_NotAcceptedIsSentAgainWithWhatAccumulated(t *testing.T) {
	store, sender := newMemStore(), &memSender{fail: errDown}
	first := store.add(3, "failed", "sink n8n: 400")
	n := mustNotifier(t, store, sender, notify.Config{})
	mustPass(t, n)
	if len(store.recorded) != 0 || store.marks["n8n"] != (notify.Mark{}) {
		t.Fatalf("mark %v after a summary not accepted, want it unmoved", store.marks["n8n"])
	}
	store.add(2, "failed", "sink n8n: 400")
	sender.setFail(nil)
	mustPass(t, n)
	got := sender.bySink("n8n")
	if len(got) != 2 || got[1].Count != 5 || got[1].Events[0].ID != first[0] || got[1].From != got[0].From {
		t.Fatalf("summaries %+v, want the second to carry all 5 from the same mark", got)
	}
	if store.marks["n8n"] != got[1].To {
		t.Errorf("mark %v, want %v", store.marks["n8n"], got[1].To)
	}
	// nats and "*" had nothing: their marks move past the rows read, so the
	// next read starts after them.
	if store.passed["nats"] != got[1].To || store.passed[notify.AnySink] != got[1].To {
		t.Errorf("quiet channels passed to %v, want %v", store.passed, got[1].To)
	}
}

// TestNotifier_ReadLimit: a pass that reads as many rows as it may says
// more follow, and the next pass goes on after them.
func TestNotifier_ReadLimit(t *testing.T) {
	store, sender := newMemStore(), &memSender{}
	ids := store.add(5, "failed", "sink n8n: 400")
	n := mustNotifier(t, store, sender, notify.Config{MaxRows: 3})
	mustPass(t, n)
	mustPass(t, n)
	got := sender.bySink("n8n")
	if len(got) != 2 || got[0].Count != 3 || !got[0].More || got[1].Count != 2 || got[1].More || got[1].Events[0].ID != ids[3] {
		t.Fatalf("summaries %+v, want 3 (more), then 2", got)
	}
	if !strings.Contains(got[0].Headline(), "and more") {
		t.Errorf("headline %q does not say more follow", got[0].Headline())
	}
}

// TestNotifier_NotClaimed: a channel whose notification another relay
// holds, or attempted less than an interval ago, is not sent.
func TestNotifier_NotClaimed(t *testing.T) {
	store, sender := newMemStore(), &memSender{}
	store.claimable = false
	store.add(3, "failed", "sink n8n: 400")
	mustPass(t, mustNotifier(t, store, sender, notify.Config{}))
	if len(sender.sent) != 0 || store.marks["n8n"] != (notify.Mark{}) {
		t.Errorf("sent %v, mark %v; want nothing sent, the mark unmoved", sender.sent, store.marks["n8n"])
	}
}

func TestNew_Invalid(t *testing.T) {
	for _, c := range []struct {
		channels []string
		want     string
	}{
		{[]string{"erp"}, `"erp" is not a configured sink`},
		{[]string{"n8n", "*", "n8n"}, `"n8n" is listed twice`},
	} {
		_, err := notify.New(notify.Config{Store: newMemStore(), Sender: &memSender{}, Sinks: []string{"n8n"}, Channels: c.channels})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("New(%q) = %v, want %q", c.channels, err, c.want)
		}
	}
}

// TestSummary_Text: the headline and the commands name the sink, quoted
// for a shell when it needs to be.
func TestSummary_Text(t *testing.T) {
	for _, c := range []struct {
		s                     notify.Summary
		headline, list, retry string
	}{
		{notify.Summary{Sink: "n8n", Count: 1, Failed: 1}, "outbox-relay: 1 event dead-lettered at sink n8n",
			"outbox-relay dlq list --sink n8n", "outbox-relay dlq retry --sink n8n"},
		{notify.Summary{Sink: "it's odd", Count: 3, Held: 3}, "outbox-relay: 3 events held for a decision at sink it's odd",
			`outbox-relay dlq list --sink 'it'\''s odd'`, `outbox-relay dlq retry --sink 'it'\''s odd'`},
		{notify.Summary{Sink: notify.AnySink, Count: 2, Failed: 2, Events: []notify.Event{{ID: 7}, {ID: 9}}},
			"outbox-relay: 2 events dead-lettered naming no sink", "outbox-relay dlq list", "outbox-relay dlq retry --ids 7,9"},
	} {
		if got := c.s.Headline(); got != c.headline {
			t.Errorf("Headline() = %q, want %q", got, c.headline)
		}
		if got := c.s.ListCommand(); got != c.list {
			t.Errorf("ListCommand() = %q, want %q", got, c.list)
		}
		if got := c.s.RetryCommand(); got != c.retry {
			t.Errorf("RetryCommand() = %q, want %q", got, c.retry)
		}
	}
}
