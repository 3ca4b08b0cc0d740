package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// result is what the run measured, for the report.
type result struct {
	took, loadTook time.Duration
	quiesced       time.Duration // writers stopped → everything delivered; -1: timed out
	unsettled      string        // what was still open when quiescing timed out
	faults         []faultRecord
	load           *load
	mon            *walMonitor
	hook           []rawDelivery
	stored, tapped []natsMessage
	events         []event
	invariants     []invariant
	relayStarts    int
	leaderTerms    int
	fallbacks      int
	settledGone    int // rows the relays logged as deleted before their outcome
	// lostInFailover: events delivered as a row of the old primary that a
	// failover lost (runFacts.lostInFailover); failovers: how many.
	lostInFailover, failovers int
	unexpected                []string
	stopErrors                []string
}

// run sets everything up, runs the load and the faults, checks the
// invariants and prints the report; it returns the number of violated
// invariants. An error means the run itself could not be carried out.
func run(ctx context.Context, o options, args []string) (int, error) {
	started := time.Now()
	s, err := setUp(ctx, o, os.Stderr)
	if err != nil {
		return 0, err
	}
	defer s.close()
	p := o.profile
	steps := schedule(p, o.seed)
	s.say("profile %s, seed %d: %d faults: %s", p.name, o.seed, len(steps), describe(steps))

	for _, r := range s.relays {
		if err := r.start(); err != nil {
			return 0, err
		}
	}
	if err := s.waitStreaming(ctx, 60*time.Second); err != nil {
		return 0, err
	}
	if _, err := s.leader(ctx, 30*time.Second); err != nil {
		return 0, err
	}
	s.say("relays running: a leader streams from slot %s, a standby waits (logs %s)", slotName, s.work)

	walLog, err := os.Create(filepath.Join(s.work, "wal-samples.csv"))
	if err != nil {
		return 0, err
	}
	defer walLog.Close()
	fmt.Fprintln(walLog, "seconds,current_lsn,retained_by_slot,unacknowledged,pg_wal_size")
	mon := &walMonitor{s: s, file: walLog}
	monCtx, stopMon := context.WithCancel(ctx)
	monDone := make(chan struct{})
	go func() { defer close(monDone); mon.run(monCtx) }()
	defer func() { stopMon(); <-monDone }()

	l := &load{pool: s.pool, writers: p.writers, aggregates: p.aggregates, rate: p.rate, seed: o.seed, since: s.since,
		largeMin: s.largeMin, largeMax: s.largeMax}
	s.load = l
	stopLoad := make(chan struct{})
	loadDone := make(chan error, 1)
	loadStart := time.Now()
	go func() { loadDone <- l.run(ctx, stopLoad) }()
	otherDone := make(chan struct{})
	go func() { defer close(otherDone); busyOtherTable(ctx, s.pool, stopLoad) }()
	progCtx, stopProgress := context.WithCancel(ctx)
	defer stopProgress()
	go s.progress(progCtx, l, mon)

	s.say("load: %d writers, %.0f events/s over %d aggregates, and about 2 MB/s of WAL into another table; warm-up %s", p.writers, p.rate, p.aggregates, p.warmup)
	sleep(ctx, p.warmup)
	var faults []faultRecord
	for i, st := range steps {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		s.say("fault %d/%d: %s (%s)", i+1, len(steps), st.kind, faultWhat[st.kind])
		for _, rec := range s.inject(ctx, st) {
			if rec.err != nil {
				s.say("fault %s: %v", rec.kind, rec.err)
			} else {
				s.say("fault %s healed after %.1f s: %s", rec.kind, (rec.healed - rec.at).Seconds(), rec.note)
			}
			faults = append(faults, rec)
		}
		sleep(ctx, st.after)
	}

	close(stopLoad)
	<-otherDone
	if err := <-loadDone; err != nil {
		return 0, fmt.Errorf("writers: %w", err)
	}
	res := &result{load: l, mon: mon, faults: faults, loadTook: time.Since(loadStart)}
	s.say("writers stopped: %d events committed; waiting for every delivery (at most %s)", l.count(), p.quiesce)
	res.quiesced, res.unsettled = s.quiesce(ctx, l.count(), neverDelivered(faults), p.quiesce)
	if ctx.Err() != nil {
		return 0, ctx.Err()
	}

	for _, r := range s.relays {
		if err := r.stop(40 * time.Second); err != nil {
			res.stopErrors = append(res.stopErrors, err.Error())
		}
		res.relayStarts += r.starts
		res.leaderTerms += r.countInLog(msgLeader)
		res.fallbacks += r.countInLog(msgFallback)
		res.settledGone += r.countInLog(msgGone)
		res.unexpected = append(res.unexpected, r.exits()...)
	}
	stopMon()
	<-monDone
	stopProgress()

	facts, err := s.collect(ctx, res)
	if err != nil {
		return 0, err
	}
	deleted := map[string]bool{}
	for k := range facts.Deleted {
		deleted[k] = true
	}
	res.invariants = append(check(facts), s.processInvariant(res), s.verifyInvariant(ctx, deleted))
	res.lostInFailover, res.failovers = facts.lostInFailover(), facts.Failovers
	// Recovery waits for neither the events a sink refused nor those
	// deleted.
	for k := range facts.hookRefused() {
		deleted[k] = true
	}
	computeRecoveries(res.faults, l.events(), facts.Sinks, deleted)
	if err := s.writeRecords(res); err != nil {
		s.say("warning: write the run's records: %v", err)
	}
	res.took = time.Since(started)
	res.print(os.Stdout, s, args)
	bad := 0
	for _, iv := range res.invariants {
		if !iv.ok() {
			bad++
		}
	}
	if bad > 0 {
		fmt.Fprintf(os.Stderr, "\noutbox-relay-chaos: %d invariants violated:\n", bad)
		for _, iv := range res.invariants {
			for _, v := range iv.Violations {
				fmt.Fprintf(os.Stderr, "- %s: %s\n", iv.Name, v)
			}
		}
		fmt.Fprintf(os.Stderr, "(seed %d; rerun with -keep to keep the logs)\n", o.seed)
	}
	return bad, nil
}

// processInvariant: every fault was injected, the relays exited only when
// the harness killed them, and SIGTERM stopped them with exit code 0.
func (s *stack) processInvariant(res *result) invariant {
	var v violations
	for _, f := range res.faults {
		if f.err != nil {
			v.add("fault %s (cycle %d) was not injected cleanly: %v", f.kind, f.cycle+1, f.err)
		}
	}
	for _, e := range res.unexpected {
		v.add("unexpected exit: %s", e)
	}
	for _, e := range res.stopErrors {
		v.add("graceful stop: %s", e)
	}
	if res.quiesced < 0 {
		v.add("not settled within %s of the writers stopping: %s", s.o.profile.quiesce, res.unsettled)
	}
	return invariant{Name: "faults injected; all settled after the load; relays exit only when killed, and 0 on SIGTERM",
		Checked: fmt.Sprintf("%d faults, %d relay starts", len(res.faults), res.relayStarts), Violations: v.result()}
}

// progress prints a line every 10 s.
func (s *stack) progress(ctx context.Context, l *load, mon *walMonitor) {
	tick := time.NewTicker(10 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		reqs, okIDs := s.hook.counts()
		w := mon.latest()
		s.say("committed %d; webhook %d requests, %d events with a 2xx; slot retains %s", l.count(), reqs, okIDs, mb(w.retained))
	}
}

// neverDelivered returns the keys of the events the faults wrote or
// deleted that need reach no sink: the over-long keys (dead-lettered
// unsent) and the rows deleted.
func neverDelivered(faults []faultRecord) map[string]bool {
	keys := map[string]bool{}
	for _, f := range faults {
		for _, k := range append(slices.Clone(f.longKeys), f.deleted...) {
			keys[k] = true
		}
	}
	return keys
}

// quiesce waits until every committed event is delivered to both sinks and
// settled (no longer pending or processing, its status marked), but those
// of never; it returns how long that took, or -1 after timeout and what
// was still open.
func (s *stack) quiesce(ctx context.Context, events int, never map[string]bool, timeout time.Duration) (time.Duration, string) {
	start := time.Now()
	last := time.Now()
	for {
		var open int
		err := s.pool.QueryRow(ctx, `SELECT count(*) FROM integration_outbox o WHERE coalesce(status, 'pending') IN ('pending', 'processing')`).Scan(&open)
		_, okIDs := s.hook.counts()
		refused, _ := s.hook.poisonedKeys()
		for k := range never {
			refused[k] = true
		}
		hookWant := events - len(refused)
		stored, serr := streamCount(ctx, s.js, streamName)
		if err == nil && serr == nil && open == 0 && okIDs >= hookWant && stored >= uint64(events-len(never)) {
			d := time.Since(start)
			s.say("quiescent after %.1f s", d.Seconds())
			return d, ""
		}
		if time.Since(start) > timeout || ctx.Err() != nil {
			open := fmt.Sprintf("%d events (%d refused by the webhook for good, over-long keys or deleted): %d rows pending or processing; the webhook has %d events, the stream %d (errors: %v, %v)",
				events, len(refused), open, okIDs, stored, err, serr)
			s.say("not quiescent after %s: %s", timeout, open)
			return -1, open
		}
		if time.Since(last) >= 5*time.Second {
			last = time.Now()
			s.say("waiting: %d of %d events open (pending or processing); the webhook has %d, the stream %d", open, events, okIDs, stored)
		}
		sleep(ctx, 250*time.Millisecond)
	}
}

// collect reads the table, the ledger, the stream and the receiver's record.
func (s *stack) collect(ctx context.Context, res *result) (runFacts, error) {
	f := runFacts{WALBound: s.o.walBound, RSSBound: s.o.rssBound, WantID: func(key string) string { return key }}
	rows, err := s.pool.Query(ctx, `SELECT id::text, event_key, coalesce(aggregate_id, ''), coalesce((payload->>'seq')::bigint, 0),
		coalesce(status, ''), coalesce(last_error, '')
		FROM `+allOutbox+` AS o ORDER BY id`)
	if err != nil {
		return f, err
	}
	f.Events, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (event, error) {
		var e event
		return e, r.Scan(&e.ID, &e.Key, &e.Agg, &e.Seq, &e.Status, &e.LastError)
	})
	if err != nil {
		return f, fmt.Errorf("read the outbox: %w", err)
	}
	res.events = f.Events
	rows, err = s.pool.Query(ctx, `SELECT event_key, action, state FROM `+allLedger+` AS l`)
	if err != nil {
		return f, err
	}
	f.Ledger, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (ledgerRow, error) {
		var l ledgerRow
		return l, r.Scan(&l.Key, &l.Action, &l.State)
	})
	if err != nil {
		return f, fmt.Errorf("read the ledger: %w", err)
	}
	f.NullStatus, f.Large = map[string]bool{}, map[string]int{}
	for _, e := range res.load.events() {
		f.Written = append(f.Written, e.key)
		if e.nullStatus {
			f.NullStatus[e.key] = true
		}
		if e.large > 0 {
			f.Large[e.key] = e.large
		}
	}
	f.Rewritten = res.load.rewrittenKeys()

	res.hook = s.hook.deliveries()
	refused, _ := s.hook.poisonedKeys()
	hook := sinkRecord{Name: "webhook", Action: hookAction, AckedRepeatsNeedCrash: true, Refused: refused}
	nats := sinkRecord{Name: "nats", Action: natsAction, Refused: map[string]bool{}}
	f.LongKeys, f.Deleted = map[string]bool{}, map[string]time.Duration{}
	for _, fr := range res.faults {
		for _, k := range fr.longKeys {
			f.LongKeys[k], hook.Refused[k], nats.Refused[k] = true, true, true
		}
		f.Beside = append(f.Beside, fr.beside...)
		for _, k := range fr.deleted {
			f.Deleted[k] = fr.deletedAt
		}
		switch fr.kind {
		case relayKill, leaderKill, postgresRestart, slotCreateCrash:
			f.Crashes = append(f.Crashes, fr.at)
		case pgBlackhole:
			// PostgreSQL out of reach, as if gone, for the whole fault: a
			// leader that cannot renew its lease or write an outcome
			// loses the slot to one that does not know the outcome.
			f.Crashes = append(f.Crashes, fr.at, fr.healed)
		case failover:
			// The primary gone with the outcomes it had not yet written
			// (and, before PostgreSQL 17, with the slot): until the
			// promotion, deliveries of the old term may still end.
			f.Crashes = append(f.Crashes, fr.at, fr.healed)
			f.Failovers++
		case lockCut:
			if fr.err == nil && fr.leader != "" {
				f.LockCuts = append(f.LockCuts, lockCutFact{At: fr.at, Leader: fr.leader})
			}
		}
	}
	f.SideEffects = map[string]int{}
	for _, d := range res.hook {
		key := bodyKey(d.Body)
		hook.Arrivals = append(hook.Arrivals, delivery{Index: d.Index, At: d.At, Key: key, ID: d.ID, Body: d.Body, OK: d.Status >= 200 && d.Status < 300, From: d.From})
		if d.Applied {
			f.SideEffects[key]++
		}
	}

	rctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	res.stored, err = readStream(rctx, s.js, streamName, s.base)
	if err != nil {
		return f, fmt.Errorf("read stream %s: %w", streamName, err)
	}
	res.tapped = s.tap.stop()
	s.tap = nil
	for i, m := range res.stored {
		nats.Arrivals = append(nats.Arrivals, delivery{Index: i, At: m.At, Key: bodyKey(m.Body), ID: m.ID, Body: m.Body, OK: true})
	}
	for i, m := range res.tapped {
		nats.Extra = append(nats.Extra, delivery{Index: i, At: m.At, Key: bodyKey(m.Body), ID: m.ID, Body: m.Body})
	}
	f.Sinks = []sinkRecord{nats, hook}
	f.MaxRetained = res.mon.maxRetained.retained
	f.PeakRSS, f.RSSBound = res.mon.peaks(), s.o.rssBound
	return f, nil
}

// bodyKey is the event_key of an envelope, "" when it does not decode.
func bodyKey(body string) string {
	var env struct {
		EventKey string `json:"event_key"`
	}
	if json.Unmarshal([]byte(body), &env) != nil {
		return ""
	}
	return env.EventKey
}

// computeRecoveries fills in each fault's recovery times from the commit
// times and the first delivery at each sink. Events a sink refused for good
// never reach it and count for neither figure.
func computeRecoveries(faults []faultRecord, events []committedEvent, sinks []sinkRecord, refused map[string]bool) {
	first := make([]map[string]time.Duration, len(sinks))
	for i, s := range sinks {
		first[i] = map[string]time.Duration{}
		for _, d := range s.Arrivals {
			if _, ok := first[i][d.Key]; d.OK && !ok {
				first[i][d.Key] = d.At
			}
		}
	}
	// bothAt is when an event had reached every sink; false if it never did.
	bothAt := func(key string) (time.Duration, bool) {
		var at time.Duration
		for _, m := range first {
			t, ok := m[key]
			if !ok {
				return 0, false
			}
			at = max(at, t)
		}
		return at, true
	}
	for i := range faults {
		f := &faults[i]
		f.firstNew, f.drained = -1, 0
		for _, e := range events {
			if refused[e.key] {
				continue
			}
			at, ok := bothAt(e.key)
			if e.at >= f.healed {
				if ok && (f.firstNew < 0 || at-f.healed < f.firstNew) {
					f.firstNew = at - f.healed
				}
				continue
			}
			switch {
			case !ok:
				f.drained = -1
			case f.drained >= 0:
				f.drained = max(f.drained, at-f.healed)
			}
		}
	}
}

// fmtRecovery formats a recovery time.
func fmtRecovery(d time.Duration) string {
	if d < 0 {
		return "never"
	}
	return fmt.Sprintf("%.2f s", d.Seconds())
}

// writeRecords writes the receiver's record and the faults as CSV into the
// work directory (kept with -keep), to study a failed run.
func (s *stack) writeRecords(res *result) error {
	var b strings.Builder
	b.WriteString("index,seconds,webhook_id,attempt,status,applied\n")
	for _, d := range res.hook {
		fmt.Fprintf(&b, "%d,%.4f,%s,%s,%d,%v\n", d.Index, d.At.Seconds(), d.ID, d.Attempt, d.Status, d.Applied)
	}
	if err := os.WriteFile(filepath.Join(s.work, "webhook-deliveries.csv"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	b.Reset()
	b.WriteString("kind,cycle,at_seconds,healed_seconds,first_new_seconds,drained_seconds,note,error\n")
	for _, f := range res.faults {
		fmt.Fprintf(&b, "%s,%d,%.2f,%.2f,%.2f,%.2f,%q,%q\n", f.kind, f.cycle+1, f.at.Seconds(), f.healed.Seconds(),
			f.firstNew.Seconds(), f.drained.Seconds(), f.note, fmt.Sprint(f.err))
	}
	return os.WriteFile(filepath.Join(s.work, "faults.csv"), []byte(b.String()), 0o644)
}
