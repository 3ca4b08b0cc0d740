package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// phaseFloor measures commit→decode latency of a bare pglogrepl client under
// the steady load, without the relay: the floor any relay on this machine,
// in this run, can reach (the reference measured on this machine kind: p50 0.65 ms, p99
// 1.4 ms when quiet; docs/performance.md). The steady phases run the same client beside the relay.
func phaseFloor(ctx context.Context, e *env, r *report) error {
	const phase, db = "floor", "bench_floor"
	url, err := e.newDatabase(ctx, db)
	if err != nil {
		return err
	}
	defer e.dropDatabase(db)
	d := min(e.o.duration/2, 10*time.Second)
	t := newTracker("fl-", int(e.o.rate*d.Seconds()))
	f, err := e.startFloor(ctx, url, "bench_floor", t, &t.floor)
	if err != nil {
		return err
	}
	o, err := e.measureLoad(ctx, r, loadPlan{name: phase, url: url, t: t, floor: true, warmup: true,
		duration: d, settle: 10 * time.Second})
	if ferr := f.close(); err == nil && ferr != nil {
		err = ferr
	}
	if err != nil {
		return err
	}
	r.add(phase, "load (bare pglogrepl client, pgoutput: the machine's floor)",
		fmt.Sprintf("%s events/s × %.0f s: %s committed (INSERT+COMMIT p50 %s, p99 %s), %s decoded", thousands(int(e.o.rate)), o.load.elapsed.Seconds(),
			thousands(o.load.sent), fmtMS(percentile(o.load.commitMS, 0.5)), fmtMS(percentile(o.load.commitMS, 0.99)), thousands(len(o.floor))), "", "info", o.usage)
	for _, q := range []struct {
		label, ref string
		p          float64
	}{{"p50", "reference 0.65 ms", 0.5}, {"p99", "reference 1.4 ms", 0.99}, {"p99.9", "—", 0.999}} {
		r.add(phase, "commit→decode "+q.label, fmtMS(percentile(o.floor, q.p)), q.ref, "floor", o.usage)
	}
	r.addCPU(phase, o.usage, "")
	return nil
}

// phaseFloorPair runs two bare clients and no relay under the steady load,
// in -floor-pair-rounds rounds of -duration with new slots each round, the
// first client's created and streaming before the second's, as the relay's
// are before the floor client's in the steady phases. The two run the same
// code on the same WAL, so how far apart they are at the tail is
// PostgreSQL's and the machine's: the spread that "within 2× of the bare
// client" (docs/performance.md) measures against.
func phaseFloorPair(ctx context.Context, e *env, r *report) error {
	const db = "bench_floor_pair"
	url, err := e.newDatabase(ctx, db)
	if err != nil {
		return err
	}
	defer e.dropDatabase(db)
	for round := 1; round <= e.o.floorPairRounds; round++ {
		if err := floorPairRound(ctx, e, r, url, round); err != nil {
			return err
		}
	}
	return nil
}

func floorPairRound(ctx context.Context, e *env, r *report, url string, round int) error {
	const phase = "floor-pair"
	t := newTracker(fmt.Sprintf("fp%d-", round), int(e.o.rate*e.o.duration.Seconds()))
	second := arrivals{at: make([]atomic.Int64, len(t.commit))}
	a, err := e.startFloor(ctx, url, fmt.Sprintf("bench_floor_pair_%d_a", round), t, &t.floor)
	if err != nil {
		return err
	}
	defer a.close()
	b, err := e.startFloor(ctx, url, fmt.Sprintf("bench_floor_pair_%d_b", round), t, &second)
	if err != nil {
		return err
	}
	defer b.close()
	o, err := e.measureLoad(ctx, r, loadPlan{name: phase, url: url, t: t, floor: true, warmup: round == 1,
		duration: e.o.duration, settle: 10 * time.Second})
	if err != nil {
		return err
	}
	for deadline := time.Now().Add(10 * time.Second); second.unique.Load() < int64(o.load.sent) && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	secondMS, secondMissing := t.latencies(&second)
	for _, c := range []*floorClient{a, b} {
		if err := c.close(); err != nil {
			return err
		}
	}
	row := func(ms []float64, missing int, l *sendLag) string {
		return fmt.Sprintf("%s / %s / %s (%s decoded, %d missing); its walsender sent %s / %s of %s transactions more than 10 / 25 ms late",
			fmtMS(percentile(ms, 0.5)), fmtMS(percentile(ms, 0.99)), fmtMS(percentile(ms, 0.999)), thousands(len(ms)), missing,
			thousands(int(l.over10.Load())), thousands(int(l.over25.Load())), thousands(int(l.total.Load())))
	}
	r.add(phase, fmt.Sprintf("round %d, the client started first: commit→decode p50 / p99 / p99.9", round), row(o.floor, o.floorMissing, &a.sent), "—", "info", o.usage)
	r.add(phase, fmt.Sprintf("round %d, the client started second", round), row(secondMS, secondMissing, &b.sent), "—", "info", o.usage)
	r.add(phase, fmt.Sprintf("round %d, p99 of the first ÷ p99 of the second", round),
		fmt.Sprintf("%.2f×", percentile(o.floor, 0.99)/percentile(secondMS, 0.99)), "—", "info", o.usage)
	r.addCPU(fmt.Sprintf("%s round %d", phase, round), o.usage, "")
	return nil
}

// floorClient is a bare pglogrepl client on a temporary slot of its own: it
// decodes pgoutput and records when each event of its tracker is decoded
// (tracker.floor). Its walsender's application_name starts with
// benchAppName.
type floorClient struct {
	// sent counts how late its walsender sent the load's transactions.
	sent   sendLag
	conn   *pgconn.PgConn
	cancel context.CancelFunc
	done   chan error

	once sync.Once
	err  error
}

// startFloor creates the temporary slot (it streams what is committed
// from now on) and starts consuming it, recording t's events' decodes in
// into (t.floor, but for the floor-pair phase's second client).
func (e *env) startFloor(ctx context.Context, url, slot string, t *tracker, into *arrivals) (*floorClient, error) {
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.RuntimeParams["replication"] = "database"
	cfg.RuntimeParams["application_name"] = benchAppName + " floor"
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if _, err := pglogrepl.CreateReplicationSlot(ctx, conn, slot, "pgoutput", pglogrepl.CreateReplicationSlotOptions{Temporary: true}); err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("create slot %s: %w", slot, err)
	}
	if err := pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names 'outbox_relay'"}}); err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("start replication on %s: %w", slot, err)
	}
	cctx, cancel := context.WithCancel(ctx)
	f := &floorClient{conn: conn, cancel: cancel, done: make(chan error, 1)}
	go func() {
		if err := e.place.pinCurrentThread(); err != nil {
			f.done <- fmt.Errorf("place the client on the relay's CPU: %w", err)
			return
		}
		f.done <- e.consumeFloor(cctx, conn, t, into, &f.sent)
	}()
	return f, nil
}

// close stops the client, drops its slot (by closing the connection) and
// returns what ended it, if not close. Safe to repeat.
func (f *floorClient) close() error {
	f.once.Do(func() {
		f.cancel()
		if err := <-f.done; err != nil {
			f.err = fmt.Errorf("pglogrepl client: %w", err)
		}
		f.conn.Close(context.Background())
	})
	return f.err
}

// sendLag counts the transactions a walsender sent more than 10 ms and
// 25 ms after their commit (PostgreSQL's commit timestamp → the send time of
// the Commit's XLogData), as the relay's walsender_lag_seconds does for the
// relay's walsender: the two walsenders decode the same WAL, so a tail that
// both show is PostgreSQL's and the machine's, not the relay's.
type sendLag struct{ over10, over25, total atomic.Int64 }

func (l *sendLag) observe(lag time.Duration) {
	l.total.Add(1)
	if lag > 10*time.Millisecond {
		l.over10.Add(1)
	}
	if lag > 25*time.Millisecond {
		l.over25.Add(1)
	}
}

// consumeFloor reads the stream, recording in into when each of t's
// inserted event_keys is decoded and how late the walsender sent each
// transaction with one (sent), and acknowledges what it received once a
// second.
func (e *env) consumeFloor(ctx context.Context, conn *pgconn.PgConn, t *tracker, into *arrivals, sent *sendLag) error {
	keyCol := map[uint32]int{} // relation id → column of event_key
	tracked := false           // the open transaction inserted an event of t
	var pos pglogrepl.LSN
	next := time.Now().Add(time.Second)
	for {
		if !time.Now().Before(next) {
			if err := pglogrepl.SendStandbyStatusUpdate(ctx, conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: pos}); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
			next = time.Now().Add(time.Second)
		}
		rctx, cancel := context.WithDeadline(ctx, next)
		msg, err := conn.ReceiveMessage(rctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if pgconn.Timeout(err) {
				continue
			}
			return err
		}
		switch m := msg.(type) {
		case *pgproto3.ErrorResponse:
			return errors.New(m.Message)
		case *pgproto3.CopyData:
			if len(m.Data) == 0 {
				continue
			}
			switch m.Data[0] {
			case pglogrepl.PrimaryKeepaliveMessageByteID:
				k, err := pglogrepl.ParsePrimaryKeepaliveMessage(m.Data[1:])
				if err != nil {
					return err
				}
				if k.ReplyRequested {
					next = time.Time{}
				}
			case pglogrepl.XLogDataByteID:
				at := e.now()
				x, err := pglogrepl.ParseXLogData(m.Data[1:])
				if err != nil {
					return err
				}
				pos = x.WALStart + pglogrepl.LSN(len(x.WALData))
				lm, err := pglogrepl.Parse(x.WALData)
				if err != nil {
					return err
				}
				switch lm := lm.(type) {
				case *pglogrepl.BeginMessage:
					tracked = false
				case *pglogrepl.CommitMessage:
					if tracked && !x.ServerTime.IsZero() {
						sent.observe(max(x.ServerTime.Sub(lm.CommitTime), 0))
					}
				case *pglogrepl.RelationMessage:
					for i, c := range lm.Columns {
						if c.Name == "event_key" {
							keyCol[lm.RelationID] = i
						}
					}
				case *pglogrepl.InsertMessage:
					if i, ok := keyCol[lm.RelationID]; ok && lm.Tuple != nil && i < len(lm.Tuple.Columns) {
						if into.record(t, string(lm.Tuple.Columns[i].Data), at) {
							tracked = true
						}
					}
				}
			}
		}
	}
}
