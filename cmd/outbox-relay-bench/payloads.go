package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// payloadSize is one shape of the payload-sizes phase: the payload's size
// and how many rows carry it (about 200 MB of payloads at the larger
// sizes, so that each drain is long enough to time).
type payloadSize struct {
	bytes int
	rows  int
}

// payloadSizes are 300 B, 4 KB, 64 KB and 1 MB payloads (1,000,000
// bytes: with the envelope and headers a message stays under NATS's
// default max_payload of 1 MiB).
func payloadSizes(quick bool) []payloadSize {
	if quick {
		return []payloadSize{{300, 10_000}, {4096, 5_000}, {65536, 500}, {1_000_000, 30}}
	}
	return []payloadSize{{300, 200_000}, {4096, 50_000}, {65536, 3_000}, {1_000_000, 200}}
}

// phasePayloadSizes drains the same relay into JetStream from a backlog
// of each payload size, against pg_recvlogical decoding the same rows in
// the same run: events/s, MB/s of payload against the ceiling's MB/s of
// WAL, the relay's peak RSS and CPU per event. Target: 64 KB payloads at
// ≥ 40% of pg_recvlogical's MB/s, and RSS within the documented bound
// (docs/performance.md, "Memory") at every size.
func phasePayloadSizes(ctx context.Context, e *env, r *report) error {
	const phase = "payload-sizes"
	saved := e.o.payloadSize
	defer func() { e.o.payloadSize = saved }()
	for _, ps := range payloadSizes(e.o.quick) {
		e.o.payloadSize = ps.bytes
		name := fmt.Sprintf("%s-%s", phase, strings.ToLower(sizeName(ps.bytes)))
		db := strings.ToLower("bench_" + strings.ReplaceAll(name, "-", "_"))
		url, err := e.newDatabase(ctx, db)
		if err != nil {
			return err
		}
		ceilingMBs, err := e.payloadCeiling(ctx, r, url, name, ps)
		if err != nil {
			e.dropDatabase(db)
			return err
		}
		s := relaySetup{name: name, url: url}
		d, err := e.drain(ctx, r, s, ps.rows, max(1, min(e.o.drainBatch, 4<<20/ps.bytes)), 2)
		e.deleteStream(s.stream())
		e.dropDatabase(db)
		if err != nil {
			return err
		}
		rate := float64(ps.rows) / d.elapsed.Seconds()
		mbs := rate * float64(ps.bytes) / 1e6
		verdict := fmt.Sprintf("%.0f%% of pg_recvlogical's %.0f MB/s", 100*mbs/ceilingMBs, ceilingMBs)
		target := "—"
		if ps.bytes == 65536 {
			target = "≥ 40% of pg_recvlogical's MB/s"
			verdict += " " + passMiss(mbs >= 0.40*ceilingMBs)
		}
		r.add(name, fmt.Sprintf("relay drain of %s rows of %s payloads → JetStream", thousands(ps.rows), sizeName(ps.bytes)),
			fmt.Sprintf("%s events/s, %.1f MB/s of payload (%.2f s); peak RSS %s; %s",
				thousands(int(rate)), mbs, d.elapsed.Seconds(), mb(d.peak), cpuPerEvent(d.usage, ps.rows)),
			target, verdict, d.usage)
		r.addCPU(name, d.usage, "")
		if err := e.payloadSteady(ctx, r, name, ps); err != nil {
			return err
		}
	}
	return nil
}

// steadyRate is the steady load of a payload size: 1,000 events/s up to
// 4 KB, 500/s of 64 KB (33 MB/s), 20/s of 1 MB.
func steadyRate(bytes int) float64 {
	switch {
	case bytes >= 1_000_000:
		return 20
	case bytes >= 65536:
		return 500
	}
	return 1000
}

// payloadSteady runs a steady load of ps's payloads, one event per
// transaction, into a fresh relay → JetStream for up to 20 s: commit→NATS
// p50/p99 and the relay's peak RSS at that size.
func (e *env) payloadSteady(ctx context.Context, r *report, name string, ps payloadSize) error {
	savedRate, savedDur := e.o.rate, e.o.duration
	defer func() { e.o.rate, e.o.duration = savedRate, savedDur }()
	e.o.rate, e.o.duration = steadyRate(ps.bytes), min(e.o.duration, 20*time.Second)
	phase := name + "-steady"
	s := relaySetup{name: phase}
	cfg, done, err := e.setUpRelay(ctx, strings.ToLower("bench_"+strings.ReplaceAll(phase, "-", "_")), &s)
	if err != nil {
		return err
	}
	defer done()
	rp, err := e.startRelay(s, cfg)
	if err != nil {
		return err
	}
	defer rp.Stop(30 * time.Second)
	if err := e.waitSlotActive(ctx, s, rp, 60*time.Second); err != nil {
		return err
	}
	t := newTracker("ps-", int(e.o.rate*e.o.duration.Seconds()))
	sub, err := e.subscribe(s, t)
	if err != nil {
		return err
	}
	defer sub.Unsubscribe()
	o, err := e.measureLoad(ctx, r, loadPlan{name: phase, url: s.url, t: t, relay: rp, nats: true, warmup: false,
		duration: e.o.duration, settle: 30 * time.Second})
	if err != nil {
		return err
	}
	r.add(phase, fmt.Sprintf("steady load of %s payloads → JetStream, %.0f events/s × %s", sizeName(ps.bytes), e.o.rate, e.o.duration),
		fmt.Sprintf("commit→NATS p50 %s, p99 %s (%d of %d arrived); relay peak RSS %s",
			fmtMS(percentile(o.nats, 0.5)), fmtMS(percentile(o.nats, 0.99)), len(o.nats), o.load.sent, mb(o.peak)),
		"", "info", o.usage)
	return nil
}

// payloadCeiling inserts ps.rows rows into url behind a slot of its own and
// times pg_recvlogical decoding them once; it returns the MB/s of payload it
// decoded, the measure the relay's payload MB/s is compared with (the WAL
// holds a large payload compressed, so its own MB/s says little). The
// relay's own slot is made by drain, after these rows: it never sees them.
func (e *env) payloadCeiling(ctx context.Context, r *report, url, name string, ps payloadSize) (float64, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	slot := strings.ToLower("bench_" + strings.ReplaceAll(name, "-", "_") + "_ceiling")
	if _, err := conn.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", slot); err != nil {
		return 0, err
	}
	defer func() { _, _ = conn.Exec(context.Background(), "SELECT pg_drop_replication_slot($1)", slot) }()
	if err := e.bulkInsert(ctx, url, "pc-", ps.rows, max(1, min(e.o.drainBatch, 4<<20/ps.bytes)), 2); err != nil {
		return 0, err
	}
	var endLSN string
	var walBytes int64
	if err := conn.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint
		FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&endLSN, &walBytes); err != nil {
		return 0, err
	}
	if err := e.quiet(ctx, name+" ceiling", r, e.roots(nil)); err != nil {
		return 0, err
	}
	c, err := e.recvlogical(ctx, url, slot, endLSN)
	if err != nil {
		return 0, err
	}
	mbs := float64(ps.rows) * float64(ps.bytes) / 1e6 / c.elapsed.Seconds()
	e.say("%s: pg_recvlogical decoded %d rows (%.1f MB of WAL) in %.2f s: %.0f MB/s of payload", name, ps.rows, float64(walBytes)/1e6, c.elapsed.Seconds(), mbs)
	// The relay's drain inserts its own rows: delete these so the relay's
	// slot, made after them, is not slowed by a table twice the size.
	if _, err := conn.Exec(ctx, "DELETE FROM integration_outbox"); err != nil {
		return 0, err
	}
	return mbs, nil
}

// sizeName names a payload size as the issue and the docs do.
func sizeName(n int) string {
	switch {
	case n >= 1_000_000:
		return fmt.Sprintf("%dMB", n/1_000_000)
	case n >= 1024:
		return fmt.Sprintf("%dKB", n/1024)
	}
	return fmt.Sprintf("%dB", n)
}
