package relay_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestCircuit_FirstDeliveryAfterRecoveryIsBounded: a sink down for 7.5 s
// opens its circuit again and again; events keep arriving every 50 ms. Once
// the sink is back, its first delivery comes within the probe interval's
// cap (2 s; docs/operations-health.md, "The bounds"), not after a cool-down
// that doubled with each opening (1, 2, 4, 8 s: up to 7.5 s here, 16 s and
// more after a longer outage).
func TestCircuit_FirstDeliveryAfterRecoveryIsBounded(t *testing.T) {
	const probeMax = 2 * time.Second
	var recoveredAt, firstDelivery atomic.Int64 // Unix nanoseconds; 0: not yet
	sink := newFakeSink("s", func(*relay.Delivery) error {
		if recoveredAt.Load() == 0 {
			return relay.SinkDownError(errors.New("dial tcp 127.0.0.1:5678: connect: connection refused"), 0)
		}
		firstDelivery.CompareAndSwap(0, time.Now().UnixNano())
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Stream: newFakeStore(), Routes: []relay.Route{{Sink: sink}}, Unordered: true})
	c := e.Stream()

	ctx, cancel := context.WithCancel(context.Background())
	submitted := make(chan error, 1)
	go func() {
		defer close(submitted)
		for id := int64(1); ctx.Err() == nil; id++ {
			if err := c.Submit(ctx, []*relay.Event{event(id, fmt.Sprint(id))}); err != nil {
				if ctx.Err() == nil {
					submitted <- err
				}
				return
			}
			c.Commit(relay.LSN(id * 100))
			time.Sleep(50 * time.Millisecond)
		}
	}()
	t.Cleanup(func() { cancel(); <-submitted })

	time.Sleep(7500 * time.Millisecond)
	recovered := time.Now()
	recoveredAt.Store(recovered.UnixNano())
	waitFor(t, "the first delivery after the sink recovered", func() bool { return firstDelivery.Load() != 0 })
	delay := time.Unix(0, firstDelivery.Load()).Sub(recovered)
	t.Logf("first delivery %v after the sink recovered", delay.Round(time.Millisecond))
	// 200 ms for the next event to arrive and the machine to be busy.
	if delay > probeMax+200*time.Millisecond {
		t.Fatalf("first delivery %v after the sink recovered; the bound is %v", delay, probeMax)
	}
	cancel()
	if err := <-submitted; err != nil {
		t.Fatal(err)
	}
}
