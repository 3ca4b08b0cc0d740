package claim_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// With the opt-in statement-level trigger, a NOTIFY wakes the claim loop:
// insert→delivery takes milliseconds although poll_interval is 5 s.
func TestNotifyWakesClaimer(t *testing.T) {
	f := MustFixture(t)
	const channel = "outbox_relay_test"
	f.MustExec(t, fmt.Sprintf(`CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_notify('%s', ''); RETURN NULL; END $$`, channel))
	f.MustExec(t, `CREATE TRIGGER outbox_notify AFTER INSERT ON integration_outbox
		FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify()`)

	type arrival struct {
		key string
		at  time.Time
	}
	arrivals := make(chan arrival, 1000)
	a := newFakeSink("a", func(d *relay.Delivery) error {
		arrivals <- arrival{d.Event.EventKey, time.Now()}
		return nil
	})
	MustStart(t, f, options{Routes: routes(a), All: true, PollInterval: 5 * time.Second, Notify: channel})
	waitFor(t, 10*time.Second, "the LISTEN connection", func() bool {
		return f.MustInt(t, `SELECT count(*) FROM pg_stat_activity WHERE query = $1`, `LISTEN "`+channel+`"`) == 1
	})

	const n = 100
	latencies := make([]time.Duration, 0, n)
	ctx := context.Background()
	for i := range n {
		key := fmt.Sprintf("k%03d", i)
		start := time.Now()
		if _, err := f.pool.Exec(ctx, `INSERT INTO integration_outbox (event_type, event_key, payload) VALUES ('x', $1, '{}')`, key); err != nil {
			t.Fatal(err)
		}
		select {
		case got := <-arrivals:
			if got.key != key {
				t.Fatalf("got %s, want %s", got.key, key)
			}
			latencies = append(latencies, got.at.Sub(start))
		case <-time.After(10 * time.Second):
			t.Fatalf("%s not delivered within 10s", key)
		}
	}
	slices.Sort(latencies)
	p50, p99 := latencies[n/2], latencies[n*99/100]
	t.Logf("insert→delivery over %d events with poll_interval 5s: p50 %s, p99 %s, max %s", n, p50, p99, latencies[n-1])
	if p50 >= 100*time.Millisecond {
		t.Errorf("p50 %s, want under 100ms", p50)
	}
}
