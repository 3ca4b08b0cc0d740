package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
)

// Sizes of the verify phase: the rows verify reads, and the messages its
// --deep run reads back from the stream.
const (
	verifyRows   = 1_000_000
	verifyStored = 200_000
)

// phaseVerify times `outbox-relay verify` (docs/operations.md, "verify")
// over 1,000,000 settled rows with their ledger rows (two sinks, one
// routed a subset of the types), and `verify --deep` reading 200,000 of
// them back from a JetStream stream. Targets: the million rows in under
// 30 s without reading the outbox outside the window; the stream at
// 50,000 messages/s or more.
func phaseVerify(ctx context.Context, e *env, r *report) error {
	const phase = "verify"
	rows, stored := verifyRows, verifyStored
	if e.o.quick {
		rows, stored = 100_000, 20_000
	}
	db := "bench_verify"
	url, err := e.newDatabase(ctx, db)
	if err != nil {
		return err
	}
	defer e.dropDatabase(db)
	stream := "BENCH_VERIFY"
	defer e.deleteStream(stream)

	e.say("%s: inserting %d settled rows and their ledger rows", phase, rows)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	for _, sql := range []string{
		`INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status, created_at, processed_at)
		 SELECT CASE WHEN g % 3 = 0 THEN 'invoice.sent' ELSE 'order.created' END, 'order', 'a' || (g % 1000), 'evt-' || g, '{"n": 1}', 'done',
		        now() - interval '2 hours' + g * interval '1 millisecond', now()
		   FROM generate_series(1, $1::int) AS g`,
		`INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
		 SELECT o.event_key, 'nats', 'delivered', 1, now() FROM integration_outbox o
		 UNION ALL
		 SELECT o.event_key, 'orders', 'delivered', 1, now() FROM integration_outbox o WHERE o.event_type = 'order.created'`,
		`VACUUM ANALYZE integration_outbox`,
		`VACUUM ANALYZE integration_idempotency`,
	} {
		var args []any
		if strings.Contains(sql, "$1") {
			args = append(args, rows)
		}
		if _, err := conn.Exec(ctx, sql, args...); err != nil {
			return fmt.Errorf("%s: %w", strings.Fields(sql)[0], err)
		}
	}

	e.say("%s: publishing %d messages into %s as the relay's sink does", phase, stored, stream)
	if err := publishStored(ctx, e.natsURL, stream, stored); err != nil {
		return err
	}

	cfg := filepath.Join(e.work, "relay-verify.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`database_url: %q
sinks:
  - name: nats
    type: nats
    url: %q
    subject: "bench.verify.{{.AggregateType}}.{{.EventType}}"
    stream: {name: %s, subjects: ["bench.verify.>"]}
  - name: orders
    type: webhook
    url: http://127.0.0.1:9/hook
    events: ["order.*"]
`, url, e.natsURL, stream)), 0o600); err != nil {
		return err
	}

	if err := e.quiet(ctx, phase, r, e.roots(nil)); err != nil {
		return err
	}
	v, took, usage, err := e.runVerify(ctx, cfg, "--since", "3h")
	if err != nil {
		return err
	}
	if v.Rows != int64(rows) || !v.Clean {
		return fmt.Errorf("verify --since 3h: %d rows (want %d), clean %v", v.Rows, rows, v.Clean)
	}
	r.add(phase, fmt.Sprintf("verify of %s settled rows (2 sinks, %s ledger rows), orphan walk included", thousands(rows), thousands(rows+rows*2/3)),
		fmt.Sprintf("%.1f s (the process: %.1f s)", v.Took, took.Seconds()), "< 30 s", passMiss(v.Took < 30), usage)

	if err := e.quiet(ctx, phase+" --deep", r, e.roots(nil)); err != nil {
		return err
	}
	v, took, usage, err = e.runVerify(ctx, cfg, "--ids", fmt.Sprintf("1-%d", stored), "--sink", "nats", "--deep")
	if err != nil {
		return err
	}
	var st *admin.StreamTally
	for _, t := range v.Sinks {
		if t.Sink == "nats" {
			st = t.Stream
		}
	}
	if !v.Clean || st == nil || st.Read != int64(stored) || st.ReadSeconds <= 0 {
		return fmt.Errorf("verify --deep: clean %v, stream %+v (want %d read)", v.Clean, st, stored)
	}
	rate := float64(st.Read) / st.ReadSeconds
	r.add(phase, fmt.Sprintf("verify --deep: the stream read back (%s messages)", thousands(stored)),
		fmt.Sprintf("%s messages/s (%.2f s; the process: %.1f s)", thousands(int(rate)), st.ReadSeconds, took.Seconds()), "≥ 50,000 messages/s", passMiss(rate >= 50_000), usage)
	return nil
}

// verifyResult is what verify --json prints.
type verifyResult struct {
	Clean bool    `json:"clean"`
	Took  float64 `json:"took_seconds"`
	admin.VerifyReport
}

// runVerify runs `outbox-relay verify --config cfg --json args…` and
// returns its report, the process's time and the CPU spent meanwhile.
func (e *env) runVerify(ctx context.Context, cfg string, args ...string) (verifyResult, time.Duration, cpuUsage, error) {
	var v verifyResult
	argv := e.place.command(append([]string{e.o.relayBin, "verify", "--config", cfg, "--json"}, args...)...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	meter := startCPU(e.roots(nil))
	began := time.Now()
	out, err := cmd.Output()
	took := time.Since(began)
	usage := meter.stop()
	if err != nil {
		return v, took, usage, fmt.Errorf("verify %q: %w\n%s%s", args, err, out, stderr.String())
	}
	if err := json.Unmarshal(out, &v); err != nil {
		return v, took, usage, fmt.Errorf("verify %q --json: %w", args, err)
	}
	return v, took, usage, nil
}

// publishStored publishes the events evt-1 … evt-n into a new stream as
// the relay's NATS sink does before the scoping of message ids (the bare
// key as Nats-Msg-Id, the event's key and id as headers).
func publishStored(ctx context.Context, url, stream string, n int) error {
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		return err
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{"bench.verify.>"}, Duplicates: 2 * time.Minute}); err != nil {
		return fmt.Errorf("create stream %s: %w", stream, err)
	}
	for i := 1; i <= n; i++ {
		m := nats.NewMsg("bench.verify.order.order_created")
		key := fmt.Sprintf("evt-%d", i)
		m.Header.Set(jetstream.MsgIDHeader, key)
		m.Header.Set(natssink.HeaderEventKey, key)
		m.Header.Set(natssink.HeaderEventID, fmt.Sprint(i))
		m.Data = []byte(`{"n": 1}`)
		if _, err := js.PublishMsgAsync(m); err != nil {
			return err
		}
	}
	select {
	case <-js.PublishAsyncComplete():
		return nil
	case <-time.After(2 * time.Minute):
		return fmt.Errorf("publishing %d messages took over 2 minutes", n)
	case <-ctx.Done():
		return ctx.Err()
	}
}
