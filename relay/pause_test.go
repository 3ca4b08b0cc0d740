package relay_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// fakePauses is a relay.PauseStore over a set the test changes.
type fakePauses struct {
	mu     sync.Mutex
	paused []string
}

func (p *fakePauses) PausedSinks(context.Context) ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.paused), nil
}

func (p *fakePauses) set(names ...string) {
	p.mu.Lock()
	p.paused = names
	p.mu.Unlock()
}

// TestEngine_PausedSinkDefersWithoutAnAttempt: a sink paused before the
// engine starts gets nothing; its events are diverted to the claim path
// without an attempt (reason paused) and the stream settles past them,
// while the other sink gets every event. A claimed row is put back the same
// way while the pause holds, and once it is lifted (read within
// relay.PausePoll) the claimed rows are delivered.
func TestEngine_PausedSinkDefersWithoutAnAttempt(t *testing.T) {
	store := newFakeStore()
	rec := &claimRecorder{settled: map[int64]relay.Decision{}}
	claims := &fakeClaimStore{settleClaim: rec.settle}
	paused, other := newFakeSink("paused", nil), newFakeSink("other", nil)
	pauses := &fakePauses{paused: []string{"paused"}}
	e := startEngine(t, relay.EngineConfig{Stream: store, Claim: claims, Owner: "me", Pauses: pauses,
		Routes: []relay.Route{{Sink: paused}, {Sink: other}}})
	c := e.Stream()
	submit(t, c, event(1, "a"), event(2, "a"), event(3, "b"))
	c.Commit(100)
	waitSettledAt(t, c, 100)
	if ids := paused.sentIDs(); len(ids) != 0 {
		t.Fatalf("paused sink was sent %v", ids)
	}
	if ids := other.sentIDs(); len(ids) != 3 || slices.Index(ids, 1) > slices.Index(ids, 2) {
		t.Fatalf("other sink sent %v, want 1, 2, 3 with 1 before 2", ids)
	}
	_, diversions, _ := store.snapshot()
	for _, id := range []int64{1, 2, 3} {
		h := diversions[id]
		if h.Kind != relay.Later || h.Attempts != 0 || h.Why != "paused" && id != 2 {
			t.Errorf("event %d: %+v, want a diversion without an attempt, reason paused", id, h)
		}
	}

	// The claim path meets the same pause.
	if _, err := e.SubmitClaimed(context.Background(), []*relay.Work{claimWork(11, "c")}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "row 11 settled", func() bool { _, ok := rec.decision(11); return ok })
	if d, _ := rec.decision(11); d.Kind != relay.Later || d.Attempts != 0 || d.Why != "paused" {
		t.Fatalf("claimed row 11 while paused: %+v, want put back without an attempt", d)
	}

	pauses.set()
	time.Sleep(2 * relay.PausePoll)
	rec.mu.Lock()
	delete(rec.settled, 11)
	rec.mu.Unlock()
	if _, err := e.SubmitClaimed(context.Background(), []*relay.Work{claimWork(11, "c")}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "row 11 settled", func() bool { _, ok := rec.decision(11); return ok })
	if d, _ := rec.decision(11); d.Kind != relay.Done {
		t.Fatalf("claimed row 11 after the resume: %+v, want done", d)
	}
	if ids := paused.sentIDs(); !slices.Equal(ids, []int64{11}) {
		t.Fatalf("resumed sink sent %v, want 11", ids)
	}
}
