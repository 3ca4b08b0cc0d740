package relay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

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
				g.Stop()
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
	g.Stop()
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
}
