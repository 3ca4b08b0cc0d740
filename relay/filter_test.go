package relay_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/relay"
)

// filterFunc is a relay.Filter of a function.
type filterFunc func(ev *relay.Event) (bool, error)

func (f filterFunc) Match(ev *relay.Event) (bool, error) { return f(ev) }

// TestEngine_FilterRoutesEachPair: a sink's filter keeps from it the
// events it refuses; an event it fails on is dead-lettered for that sink
// only, unsent there and naming the error, while the other sink gets it
// and the stream goes on (docs/sinks.md, "Filters").
func TestEngine_FilterRoutesEachPair(t *testing.T) {
	t.Parallel()
	store := newFakeStore()
	a := newFakeSink("a", func(*relay.Delivery) error { return nil })
	b := newFakeSink("b", func(*relay.Delivery) error { return nil })
	var calls []int64
	filter := filterFunc(func(ev *relay.Event) (bool, error) {
		calls = append(calls, ev.ID)
		switch ev.ID {
		case 2:
			return false, nil
		case 3:
			return false, errors.New("no such key: amount")
		}
		return true, nil
	})
	e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: a, Filter: filter}, {Sink: b}}})
	c := e.Stream()
	submit(t, c, event(1, "x"), event(2, "x"), event(3, "x"), event(4, "x"))
	c.Commit(100)
	waitSettledAt(t, c, 100)

	if got := a.sentIDs(); !slices.Equal(got, []int64{1, 4}) {
		t.Errorf("sink a got %v, want [1 4]: its filter refuses 2 and fails on 3", got)
	}
	if got := b.sentIDs(); !slices.Equal(got, []int64{1, 2, 3, 4}) {
		t.Errorf("sink b got %v, want every event", got)
	}
	if !slices.Equal(calls, []int64{1, 2, 3, 4}) {
		t.Errorf("the filter ran on %v, want once per event", calls)
	}
	delivered, _, dead := store.snapshot()
	if len(dead) != 1 || !strings.Contains(dead[3], "sink a: filter: no such key: amount") {
		t.Fatalf("dead letters %v, want event 3 only, naming sink a's filter error", dead)
	}
	for key, want := range map[relay.LedgerKey]int{{EventKey: "k2", Action: "a"}: 0, {EventKey: "k3", Action: "a"}: 0, {EventKey: "k3", Action: "b"}: 1, {EventKey: "k4", Action: "a"}: 1} {
		if delivered[key] != want {
			t.Errorf("%v: %d delivered ledger rows, want %d", key, delivered[key], want)
		}
	}
}
