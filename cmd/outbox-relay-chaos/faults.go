package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// faultKind is one kind of fault; faultKinds lists them in report order.
type faultKind string

const (
	relayKill       faultKind = "relay-kill"
	postgresRestart faultKind = "postgres-restart"
	natsRestart     faultKind = "nats-restart"
	webhookOutage   faultKind = "webhook-outage"
	slotDrop        faultKind = "slot-drop"
	leaderKill      faultKind = "leader-kill"
	backpressure    faultKind = "backpressure-drop"
	unstorable      faultKind = "unstorable-reply"
	slotCreateCrash faultKind = "slot-create-crash"
	settleLock      faultKind = "settle-lock"
	pgBlackhole     faultKind = "pg-blackhole"
	natsBlackhole   faultKind = "nats-blackhole"
	pgSlow          faultKind = "pg-slow"
	failover        faultKind = "failover"
	gracefulStop    faultKind = "graceful-stop"
	pollFallback    faultKind = "poll-fallback"
	lockCut         faultKind = "lock-cut"
	handoverDelete  faultKind = "handover-delete"
	longKeys        faultKind = "long-keys"
)

var faultKinds = []faultKind{relayKill, postgresRestart, natsRestart, webhookOutage, slotDrop, leaderKill,
	backpressure, unstorable, slotCreateCrash, settleLock, pgBlackhole, natsBlackhole, pgSlow, failover,
	gracefulStop, pollFallback, lockCut, handoverDelete, longKeys}

// faultWhat says what each kind does, for the report.
var faultWhat = map[faultKind]string{
	relayKill:       "kill -9 of both relay processes, restarted at once",
	postgresRestart: "SIGKILL of the postmaster (crash), then start",
	natsRestart:     "SIGKILL of nats-server, start on the same port and store",
	webhookOutage:   "receiver answers 503, then holds requests past the relay's timeout, then answers slowly (another fault meanwhile)",
	slotDrop:        "walsender terminated, pg_drop_replication_slot",
	leaderKill:      "kill -9 of the HA leader; restarted as standby after the takeover",
	backpressure:    "receiver answers 2xx after 0.6 × the timeout (lanes fill, decoding waits), then the walsender is terminated, then the receiver heals",
	unstorable:      "receiver refuses a few events for good: 400 with a 700-byte multi-byte UTF-8 body holding a NUL (they must end failed, with a reason)",
	slotCreateCrash: "slot dropped, then kill -9 of both relays as soon as the slot exists again, restarted",
	settleLock:      "LOCK TABLE of the ledger IN EXCLUSIVE MODE, held (settlement writes wait), then released",
	pgBlackhole:     "the relays' open connections to PostgreSQL black-holed (sockets open, nothing forwarded; new connections pass), then healed",
	natsBlackhole:   "the relays' open connections to nats-server black-holed likewise, then healed",
	pgSlow:          "300 ms added to every round trip between the relays and PostgreSQL, then removed",
	failover:        "kill -9 of the primary, pg_promote of its synchronous standby; everyone follows the multi-host URL; a new standby is built on the old primary's port",
	gracefulStop:    "SIGTERM of the HA leader while it delivers (it must record what is in flight and exit 0 within shutdown_timeout), restarted at once",
	pollFallback:    "the publication dropped and the walsender terminated: auto mode falls back to the claim path over every row; the publication restored, it streams again after replication_retry",
	lockCut:         "the leader's lock session ended (pg_terminate_backend) while it delivers: it must send nothing once it knows (its next ping); the standby takes over",
	handoverDelete:  "receiver slow; slot dropped; rows with a NULL status committed while no slot exists; once the new slot's hand-over has read its rows, a few pending rows the webhook has not got deleted (DELETE … WHERE id = ANY), then the walsender terminated: the hand-over must be recorded and streaming resume within 60 s",
	longKeys:        "one transaction of legacy rows (key bound trigger off) in an aggregate of its own: a few keys of 2,049–2,690 random bytes between rows with normal keys: those must end failed naming the limit, unsent; the others delivered",
}

// step is one fault of the schedule.
type step struct {
	kind  faultKind
	cycle int
	round int           // relay-kill: which of the profile's kills
	pause time.Duration // relay-kill, restarts: how long the process stays down
	after time.Duration // quiet time before the next step
	// during (webhook-outage) is a fault injected halfway through the
	// outage's slow phase, while deliveries queue up in the relay.
	during faultKind
	// nested: this is that fault; the outage waits for the recovery.
	nested bool
}

// duringOutage is what cycle c injects in the middle of its webhook outage:
// the same for every seed, so that each profile always covers the first.
var duringOutage = []faultKind{slotDrop, leaderKill, relayKill}

// closeShare of the faults are followed by the next one after only
// closeGap (±50%), while the first is still recovering (a kill while the
// claim path drains the outage's backlog, say); the others by p.gap.
const (
	closeShare = 0.3
	closeGap   = 2 * time.Second
)

// schedule draws the run's faults from seed: each cycle injects every kind
// once, in a shuffled order, relay-kill as p.kills kills in a row.
func schedule(p profile, seed uint64) []step {
	rng := rand.New(rand.NewPCG(seed, 0x6368616f73))
	jitter := func(d time.Duration, frac float64) time.Duration {
		return time.Duration(float64(d) * (1 - frac + 2*frac*rng.Float64()))
	}
	var steps []step
	for c := range p.cycles {
		kinds := slices.Clone(faultKinds)
		rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
		for _, k := range kinds {
			gap := jitter(p.gap, 0.2)
			if rng.Float64() < closeShare {
				gap = jitter(closeGap, 0.5)
			}
			pause := jitter(500*time.Millisecond, 0.6)
			if k != relayKill {
				st := step{kind: k, cycle: c, pause: pause, after: gap}
				if k == webhookOutage {
					st.during = duringOutage[c%len(duringOutage)]
				}
				steps = append(steps, st)
				continue
			}
			for r := range p.kills {
				after := jitter(p.killSpacing, 0.5)
				if r == p.kills-1 {
					after = gap
				}
				steps = append(steps, step{kind: k, cycle: c, round: r, pause: jitter(500*time.Millisecond, 0.6), after: after})
			}
		}
	}
	return steps
}

// describe is the schedule in one line.
func describe(steps []step) string {
	var parts []string
	for _, st := range steps {
		during := ""
		if st.during != "" {
			during = "[" + string(st.during) + "]"
		}
		parts = append(parts, fmt.Sprintf("%s%s(+%.0fs)", st.kind, during, st.after.Seconds()))
	}
	return strings.Join(parts, " ")
}

// faultRecord is one injected fault and what followed.
type faultRecord struct {
	step
	at, healed time.Duration // since the run's start
	note       string
	err        error
	leader     string // lock-cut: the relay that led
	// handover-delete: the keys of the rows deleted, and when the DELETE
	// committed.
	deleted   []string
	deletedAt time.Duration
	// long-keys: the over-long keys, and the rows written beside them.
	longKeys, beside []string
	// Filled in after the run; -1: never.
	firstNew time.Duration // healed → the first event committed afterwards at both sinks
	drained  time.Duration // healed → every event committed before it at both sinks
}

// inject injects one fault and returns once it is healed, with its record
// first and then that of a fault injected during it.
func (s *stack) inject(ctx context.Context, st step) []faultRecord {
	rec := faultRecord{step: st, at: s.since()}
	var during []faultRecord
	switch st.kind {
	case relayKill:
		for _, r := range s.relays {
			r.kill()
		}
		sleep(ctx, st.pause)
		for _, r := range s.relays {
			rec.err = errors.Join(rec.err, r.restart())
		}
		rec.healed = s.since()
		rec.note = fmt.Sprintf("down %.1f s", (rec.healed - rec.at).Seconds())
	case postgresRestart:
		rec.err = s.cluster.Kill()
		sleep(ctx, st.pause)
		if err := s.cluster.Start(ctx); err != nil {
			rec.err = errors.Join(rec.err, err)
		}
		rec.healed = s.since()
		rec.note = fmt.Sprintf("down %.1f s", (rec.healed - rec.at).Seconds())
	case natsRestart:
		rec.err = s.nats.Kill()
		sleep(ctx, st.pause)
		if err := s.nats.Start(); err != nil {
			rec.err = errors.Join(rec.err, err)
		} else if nc, err := s.nats.Connect(ctx, 15*time.Second); err != nil {
			rec.err = errors.Join(rec.err, err)
		} else {
			nc.Close()
		}
		rec.healed = s.since()
		rec.note = fmt.Sprintf("down %.1f s", (rec.healed - rec.at).Seconds())
	case webhookOutage:
		p := s.o.profile
		s.hook.setMode(hook503)
		sleep(ctx, p.outage503)
		s.hook.setMode(hookHang)
		sleep(ctx, p.outageHang)
		s.hook.setMode(hookSlow)
		slowEnds := time.Now().Add(p.outageSlow)
		if st.during != "" {
			sleep(ctx, p.outageSlow/2)
			// A slot dropped now is recreated only once the deliveries in
			// flight have settled, which the slow phase holds back: the
			// wait for streaming comes after the outage heals.
			during = s.inject(ctx, step{kind: st.during, cycle: st.cycle, pause: st.pause, nested: true})
			during[0].note += " (during the webhook outage's slow phase)"
		}
		sleep(ctx, time.Until(slowEnds))
		s.hook.setMode(hookHealthy)
		rec.healed = s.since()
		if st.during == slotDrop && during[0].err == nil {
			if err := s.waitStreaming(ctx, 60*time.Second); err != nil {
				during[0].err = err
			} else {
				during[0].note = fmt.Sprintf("%s; streaming again %.1f s after the outage healed", during[0].note, (s.since() - rec.healed).Seconds())
			}
		}
		rec.note = fmt.Sprintf("503 for %.0f s, held for %.0f s, slow for %.0f s", p.outage503.Seconds(), p.outageHang.Seconds(), p.outageSlow.Seconds())
		if st.during != "" {
			rec.note += ", " + string(st.during) + " halfway through"
		}
	case slotDrop:
		attempts, err := s.dropSlot(ctx)
		rec.healed = s.since()
		if err != nil {
			rec.err = err
			break
		}
		if st.nested {
			rec.note = fmt.Sprintf("dropped at attempt %d", attempts)
			break
		}
		if err := s.waitStreaming(ctx, 60*time.Second); err != nil {
			rec.err = err
			break
		}
		rec.note = fmt.Sprintf("dropped at attempt %d; streaming again after %.1f s", attempts, (s.since() - rec.healed).Seconds())
	case leaderKill:
		leader, err := s.leader(ctx, 30*time.Second)
		if err != nil {
			rec.err = err
			rec.healed = s.since()
			break
		}
		rec.at = s.since()
		leader.kill()
		rec.healed = rec.at // the takeover is the recovery
		took, err := s.takeover(ctx, leader, 30*time.Second)
		if err != nil {
			rec.err = err
		} else {
			rec.note = fmt.Sprintf("%s killed; the standby led after %.1f s", leader.name, took.Seconds())
		}
		rec.err = errors.Join(rec.err, leader.restart())
	case backpressure:
		p := s.o.profile
		s.hook.setMode(hookCrawl)
		sleep(ctx, p.crawl)
		// The walsender may be between two sessions (a reconnect after a
		// lane timeout, say): wait up to 10 s for one to terminate.
		var n int
		var err error
		for end := time.Now().Add(10 * time.Second); ; {
			n, err = s.terminateWalsender(ctx)
			if err != nil || n > 0 || time.Now().After(end) || !sleep(ctx, 50*time.Millisecond) {
				break
			}
		}
		if err == nil && n == 0 {
			err = errors.New("no walsender streamed from the slot within 10 s to terminate")
		}
		sleep(ctx, p.crawl/2)
		s.hook.setMode(hookHealthy)
		rec.healed = s.since()
		if err != nil {
			rec.err = err
			break
		}
		if err := s.waitStreaming(ctx, 60*time.Second); err != nil {
			rec.err = err
			break
		}
		rec.note = fmt.Sprintf("crawling answers for %.0f s, walsender terminated, %.0f s more; streaming again %.1f s after the heal",
			p.crawl.Seconds(), (p.crawl / 2).Seconds(), (s.since() - rec.healed).Seconds())
	case unstorable:
		p := s.o.profile
		s.hook.poison(p.poison)
		deadline := time.Now().Add(15 * time.Second)
		for {
			_, left := s.hook.poisonedKeys()
			if left == 0 || time.Now().After(deadline) || !sleep(ctx, 50*time.Millisecond) {
				break
			}
		}
		s.hook.stopPoisoning()
		keys, _ := s.hook.poisonedKeys()
		rec.healed = s.since()
		rec.note = fmt.Sprintf("%d events refused for good (%d in the run so far)", p.poison, len(keys))
	case slotCreateCrash:
		attempts, err := s.dropSlot(ctx)
		if err != nil {
			rec.err = err
			rec.healed = s.since()
			break
		}
		dropped := s.since()
		if err := s.waitSlot(ctx, 60*time.Second); err != nil {
			rec.err = err
			rec.healed = s.since()
			break
		}
		created := s.since()
		for _, r := range s.relays {
			r.kill()
		}
		killed := s.since()
		sleep(ctx, st.pause)
		for _, r := range s.relays {
			rec.err = errors.Join(rec.err, r.restart())
		}
		rec.healed = s.since()
		if err := s.waitStreaming(ctx, 60*time.Second); err != nil {
			rec.err = errors.Join(rec.err, err)
			break
		}
		rec.note = fmt.Sprintf("dropped at attempt %d; the slot was back %.2f s later; both relays killed %.0f ms after that; streaming again %.1f s after the restart",
			attempts, (created - dropped).Seconds(), float64((killed - created).Milliseconds()), (s.since() - rec.healed).Seconds())
	case settleLock:
		hold := s.o.profile.lockHold
		peak, err := s.holdSettleLock(ctx, hold)
		rec.healed = s.since()
		if err != nil {
			rec.err = err
			break
		}
		rec.note = fmt.Sprintf("held %.0f s; the relays' largest RSS meanwhile %s", hold.Seconds(), mb(peak))
	case pgBlackhole, natsBlackhole:
		proxies := s.pgProxies
		if st.kind == natsBlackhole {
			proxies = s.natsProxies
		}
		open := 0
		for _, p := range proxies {
			open += p.Conns()
			p.BlackHole(netfault.NewConnsPass)
		}
		sleep(ctx, s.o.profile.blackhole)
		for _, p := range proxies {
			p.Pass()
		}
		rec.healed = s.since()
		rec.note = fmt.Sprintf("%d open connections black-holed for %.0f s", open, s.o.profile.blackhole.Seconds())
	case failover:
		rec.note, rec.err = s.failover(ctx, &rec)
	case gracefulStop:
		leader, err := s.leader(ctx, 30*time.Second)
		if err != nil {
			rec.err = err
			rec.healed = s.since()
			break
		}
		rec.at = s.since()
		stopErr := leader.terminate(25 * time.Second)
		stopped := s.since()
		rec.err = errors.Join(stopErr, leader.restart())
		rec.healed = s.since()
		rec.note = fmt.Sprintf("%s stopped in %.1f s", leader.name, (stopped - rec.at).Seconds())
	case pollFallback:
		rec.note, rec.err = s.pollFallback(ctx)
		rec.healed = s.since()
	case lockCut:
		leader, err := s.leader(ctx, 30*time.Second)
		if err != nil {
			rec.err = err
			rec.healed = s.since()
			break
		}
		var before int32
		_ = s.pool.QueryRow(ctx, `SELECT coalesce(max(active_pid), 0) FROM pg_replication_slots WHERE slot_name = $1`, slotName).Scan(&before)
		rec.at = s.since()
		var n int
		if err := s.pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE application_name = 'outbox-relay leader '||$1 AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted)`, slotName).Scan(&n); err != nil || n != 1 {
			rec.err = fmt.Errorf("end the leader's lock session: %d ended, %v", n, err)
			rec.healed = s.since()
			break
		}
		rec.leader = leader.name
		rec.healed = rec.at
		// Streaming again: a walsender other than the old leader's.
		for deadline := time.Now().Add(30 * time.Second); ; {
			var pid int32
			err := s.pool.QueryRow(ctx, `SELECT coalesce(max(active_pid), 0) FROM pg_replication_slots WHERE slot_name = $1`, slotName).Scan(&pid)
			if err == nil && pid != 0 && pid != before {
				break
			}
			if time.Now().After(deadline) || !sleep(ctx, 20*time.Millisecond) {
				rec.err = fmt.Errorf("no new walsender on slot %s within 30 s of the lock cut", slotName)
				break
			}
		}
		rec.note = fmt.Sprintf("%s's lock session ended; a new walsender streams %.1f s after", leader.name, (s.since() - rec.at).Seconds())
	case handoverDelete:
		rec.note, rec.err = s.handoverDelete(ctx, &rec)
		if rec.healed == 0 {
			rec.healed = s.since()
		}
	case longKeys:
		rec.note, rec.err = s.writeLongKeys(ctx, &rec)
	case pgSlow:
		for _, p := range s.pgProxies {
			p.SetLatency(netfault.Upstream, 150*time.Millisecond)
			p.SetLatency(netfault.Downstream, 150*time.Millisecond)
		}
		sleep(ctx, s.o.profile.slowFor)
		for _, p := range s.pgProxies {
			p.SetLatency(netfault.Upstream, 0)
			p.SetLatency(netfault.Downstream, 0)
		}
		rec.healed = s.since()
		rec.note = fmt.Sprintf("for %.0f s", s.o.profile.slowFor.Seconds())
	}
	return append([]faultRecord{rec}, during...)
}

// pollFallback drops the publication and ends the walsender: the leader's
// next session finds replication unavailable and auto mode falls back to
// the claim path over every row, on a fresh engine once the stream's last
// deliveries are written. Then it restores the publication and waits for a
// relay to stream again (after replication_retry, through a new slot's
// hand-over).
func (s *stack) pollFallback(ctx context.Context) (string, error) {
	before := 0
	for _, r := range s.relays {
		before += r.countInLog(msgFallback)
	}
	if _, err := s.pool.Exec(ctx, `DROP PUBLICATION outbox_relay`); err != nil {
		return "", fmt.Errorf("drop the publication: %w", err)
	}
	restore := func() error {
		_, err := s.pool.Exec(context.WithoutCancel(ctx), `CREATE PUBLICATION outbox_relay FOR TABLE integration_outbox WITH (publish = 'insert')`)
		return err
	}
	if _, err := s.terminateWalsender(ctx); err != nil {
		return "", errors.Join(err, restore())
	}
	start := time.Now()
	fellBack := false
	for time.Since(start) < 30*time.Second && sleep(ctx, 100*time.Millisecond) {
		n := 0
		for _, r := range s.relays {
			n += r.countInLog(msgFallback)
		}
		if n > before {
			fellBack = true
			break
		}
	}
	took := time.Since(start)
	sleep(ctx, s.o.profile.replicationRetry/2) // polling
	if err := restore(); err != nil {
		return "", fmt.Errorf("restore the publication: %w", err)
	}
	if !fellBack {
		return "", fmt.Errorf("no relay fell back to polling within 30 s of the publication's drop")
	}
	restored := time.Now()
	if err := s.waitStreaming(ctx, 60*time.Second); err != nil {
		return "", err
	}
	return fmt.Sprintf("polling %.1f s after the drop; streaming again %.1f s after the publication was restored", took.Seconds(), time.Since(restored).Seconds()), nil
}

// failover kills the primary, promotes its standby after st.pause (a
// failover manager's detection time) and releases the synchronous commits
// waiting for a standby that is no more; that is the heal. Then it waits for
// a relay to stream again and builds a new synchronous standby of the new
// primary on the old one's port (pg_basebackup when the bin dir has it,
// else a cold copy, which restarts the new primary).
func (s *stack) failover(ctx context.Context, rec *faultRecord) (string, error) {
	if s.standby == nil {
		rec.healed = s.since()
		return "", errors.New("no standby to promote (an earlier failover could not build one)")
	}
	old, next := s.cluster, s.standby
	port := old.Port()
	err := old.Kill()
	sleep(ctx, rec.pause)
	if perr := next.Promote(ctx); perr != nil {
		rec.healed = s.since()
		return "", errors.Join(err, perr)
	}
	err = errors.Join(err, setSyncStandby(ctx, next, ""))
	rec.healed = s.since()
	s.cluster, s.standby = next, nil
	err = errors.Join(err, old.Close())

	var synced bool
	if qerr := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1)`, slotName).Scan(&synced); qerr != nil {
		err = errors.Join(err, qerr)
	}
	slot := "no copy of the slot on the promoted standby (the relay creates it and hands the rows pending to the claim path)"
	if synced {
		slot = "the slot was synced to the promoted standby"
	}
	if werr := s.waitStreaming(ctx, 60*time.Second); werr != nil {
		return slot, errors.Join(err, werr)
	}
	streaming := s.since() - rec.healed

	online := next.CanCopyOnline()
	how := "a cold copy (a restart of the new primary)"
	if online {
		how = "pg_basebackup"
	}
	start := time.Now()
	standby, serr := next.StartStandby(ctx, standbyOptions(port, online, s.pgLog))
	if serr != nil {
		return slot, errors.Join(err, fmt.Errorf("build a new standby: %w", serr))
	}
	s.standby = standby
	err = errors.Join(err, setSyncStandby(ctx, next, standbyAppName))
	return fmt.Sprintf("primary killed, standby promoted after %.1f s; %s; streaming again %.1f s after the promotion; a new synchronous standby built with %s in %.1f s",
		(rec.healed - rec.at).Seconds(), slot, streaming.Seconds(), how, time.Since(start).Seconds()), err
}

// terminateWalsender ends the backend streaming from the slot, if any, and
// returns how many it ended.
func (s *stack) terminateWalsender(ctx context.Context) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(active_pid)) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL`, slotName).Scan(&n)
	return n, err
}

// waitSlot polls, every 2 ms, until the slot exists.
func (s *stack) waitSlot(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var exists bool
		err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1)`, slotName).Scan(&exists)
		if err == nil && exists {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("slot %s not created again within %s (last error %v)", slotName, timeout, err)
		}
		if !sleep(ctx, 2*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// holdSettleLock locks the ledger in EXCLUSIVE mode (reads pass, every write waits) for hold, and returns the largest
// RSS of a relay process sampled meanwhile.
func (s *stack) holdSettleLock(ctx context.Context, hold time.Duration) (int64, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '10s'`); err != nil {
		return 0, err
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE integration_idempotency IN EXCLUSIVE MODE`); err != nil {
		return 0, fmt.Errorf("lock: %w", err)
	}
	var peak int64
	end := time.Now().Add(hold)
	for time.Now().Before(end) && sleep(ctx, 250*time.Millisecond) {
		for _, r := range s.relays {
			peak = max(peak, r.rss())
		}
	}
	return peak, tx.Commit(ctx)
}

// dropSlot terminates the walsender on the slot and drops it, retrying
// while the relay reconnects.
func (s *stack) dropSlot(ctx context.Context) (int, error) {
	var err error
	for attempt := 1; attempt <= 400; attempt++ {
		_, _ = s.pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL`, slotName)
		if _, err = s.pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, slotName); err == nil {
			return attempt, nil
		}
		sleep(ctx, 5*time.Millisecond)
	}
	return 0, fmt.Errorf("could not drop slot %s: %w", slotName, err)
}

// takeover waits until a relay other than killed leads the slot and
// streams.
func (s *stack) takeover(ctx context.Context, killed *relaySlot, timeout time.Duration) (time.Duration, error) {
	start := time.Now()
	for {
		for _, r := range s.relays {
			if r != killed && r.leading() {
				if err := s.waitStreaming(ctx, timeout-time.Since(start)); err != nil {
					return 0, err
				}
				return time.Since(start), nil
			}
		}
		if time.Since(start) > timeout {
			return 0, fmt.Errorf("no standby took over within %s of the leader's kill", timeout)
		}
		if !sleep(ctx, 20*time.Millisecond) {
			return 0, ctx.Err()
		}
	}
}

// sleep waits d or until ctx ends; false means ctx ended.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
