package relay_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/outbox-relay/outbox-relay/relay"
)

func untilDone(ctx context.Context) error { <-ctx.Done(); return nil }

func TestGroup(t *testing.T) {
	for _, c := range []struct {
		name    string
		workers map[string]func(ctx context.Context) error
		stop    bool   // the owner stops the group
		want    string // substring of Wait's error; "" for nil
	}{
		{"workers that run until stopped", map[string]func(context.Context) error{
			"a": untilDone, "b": func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() },
		}, true, ""},
		{"a worker returning nil early", map[string]func(context.Context) error{
			"lane nats": func(context.Context) error { return nil }, "b": untilDone,
		}, false, "lane nats stopped while its owner still ran"},
		{"a worker failing", map[string]func(context.Context) error{
			"settle stream": func(context.Context) error { return errors.New("table dropped") }, "b": untilDone,
		}, false, "settle stream: table dropped"},
		{"a worker panicking", map[string]func(context.Context) error{
			"lane hook": func(context.Context) error { panic("sink bug") }, "b": untilDone,
		}, false, "lane hook panicked: sink bug"},
	} {
		t.Run(c.name, func(t *testing.T) {
			g, _ := relay.NewGroup(context.Background())
			for name, w := range c.workers {
				g.Go(name, w)
			}
			if c.stop {
				time.Sleep(10 * time.Millisecond)
				g.Cancel()
			}
			done := make(chan error, 1)
			go func() { done <- g.Wait() }()
			select {
			case err := <-done:
				switch {
				case c.want == "" && err != nil:
					t.Fatalf("Wait = %v, want nil", err)
				case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
					t.Fatalf("Wait = %v, want an error containing %q", err, c.want)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("Wait did not return: a failed worker did not stop its siblings")
			}
		})
	}
}

func TestGroupTaskMayFinish(t *testing.T) {
	g, _ := relay.NewGroup(context.Background())
	g.GoTask("startup pass", func(context.Context) error { return nil })
	g.Go("worker", untilDone)
	time.Sleep(20 * time.Millisecond)
	if err := g.Failed(); err != nil {
		t.Fatalf("a task that finished failed the group: %v", err)
	}
	if err := g.Stop(); err != nil {
		t.Fatal(err)
	}
}

// TestGroupStop: Stop cancels and waits — no worker runs after it returns —
// returns the first failure, the same on every call, and is safe before any
// worker was started.
func TestGroupStop(t *testing.T) {
	empty, _ := relay.NewGroup(context.Background())
	if err := empty.Stop(); err != nil {
		t.Fatalf("Stop of a group without workers = %v, want nil", err)
	}

	g, _ := relay.NewGroup(context.Background())
	var returned atomic.Bool
	g.Go("slow to stop", func(ctx context.Context) error {
		<-ctx.Done()
		time.Sleep(50 * time.Millisecond) // its own goroutines winding down
		returned.Store(true)
		return nil
	})
	if err := g.Stop(); err != nil {
		t.Fatalf("Stop = %v, want nil", err)
	}
	if !returned.Load() {
		t.Fatal("Stop returned before its worker did")
	}

	failing, _ := relay.NewGroup(context.Background())
	failing.Go("claim path", func(context.Context) error { return errors.New("claim path: owner lock lost") })
	failing.Go("sweeper", untilDone)
	first := failing.Stop()
	if first == nil || first.Error() != "claim path: owner lock lost" {
		t.Fatalf("Stop = %v, want the worker's failure named once", first)
	}
	if again := failing.Stop(); again != first {
		t.Fatalf("second Stop = %v, want %v", again, first)
	}
}

// leakyService is a service whose Stop cancels its worker but does not wait
// for it: the shape the contract (relay.Group) rules out.
type leakyService struct {
	cancel  context.CancelFunc
	release chan struct{}
	ended   chan struct{}
}

func (s *leakyService) Start(ctx context.Context) {
	ctx, s.cancel = context.WithCancel(ctx)
	go func() {
		defer close(s.ended)
		<-ctx.Done()
		<-s.release // still winding down when Stop has returned
	}()
}

func (s *leakyService) Stop() { s.cancel() }

// TestLeakCheckCatchesAStopThatDoesNotWait: the leak check every package's
// TestMain runs (goleak) names a worker still running after its owner's
// stop returned, and finds nothing once the same worker runs in a Group.
func TestLeakCheckCatchesAStopThatDoesNotWait(t *testing.T) {
	before := goleak.IgnoreCurrent()

	leaky := &leakyService{release: make(chan struct{}), ended: make(chan struct{})}
	leaky.Start(context.Background())
	leaky.Stop()
	err := goleak.Find(before)
	close(leaky.release)
	<-leaky.ended
	if err == nil || !strings.Contains(err.Error(), "leakyService") {
		t.Fatalf("goleak.Find after a stop that does not wait = %v, want the leaked worker named", err)
	}

	release := make(chan struct{})
	time.AfterFunc(50*time.Millisecond, func() { close(release) })
	g, _ := relay.NewGroup(context.Background())
	g.Go("worker", func(ctx context.Context) error {
		<-ctx.Done()
		<-release
		return nil
	})
	if err := g.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := goleak.Find(before); err != nil {
		t.Fatalf("goleak.Find after Group.Stop = %v, want nothing left", err)
	}
}
