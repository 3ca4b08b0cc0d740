package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// phaseFloor measures commit→decode latency of a bare pglogrepl client under
// the steady load: the floor any relay on this machine, in this run, can
// reach (SPEC §6 reference: p50 0.65 ms, p99 1.4 ms on a quiet machine).
func phaseFloor(ctx context.Context, e *env, r *report) error {
	const phase, db, slot = "floor", "bench_floor", "bench_floor"
	url, err := e.newDatabase(ctx, db)
	if err != nil {
		return err
	}
	defer e.dropDatabase(db)
	d := min(e.o.duration/2, 10*time.Second)
	t := newTracker("fl-", int(e.o.rate*d.Seconds()))
	conn, err := pgconn.Connect(ctx, url+"&replication=database")
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if _, err := pglogrepl.CreateReplicationSlot(ctx, conn, slot, "pgoutput", pglogrepl.CreateReplicationSlotOptions{Temporary: true}); err != nil {
		return fmt.Errorf("create slot: %w", err)
	}
	if err := pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names 'outbox_relay'"}}); err != nil {
		return fmt.Errorf("start replication: %w", err)
	}
	cctx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- e.consumeFloor(cctx, conn, t) }()
	o, err := e.measureLoad(ctx, r, loadPlan{name: phase, url: url, t: t, nats: true, warmup: true,
		duration: d, settle: 10 * time.Second})
	stop()
	if cerr := <-done; err == nil && cerr != nil {
		err = fmt.Errorf("pglogrepl client: %w", cerr)
	}
	if err != nil {
		return err
	}
	r.add(phase, "load (bare pglogrepl client, pgoutput: the machine's floor)",
		fmt.Sprintf("%s events/s × %.0f s: %s committed (INSERT+COMMIT p50 %s, p99 %s), %s decoded", thousands(int(e.o.rate)), o.load.elapsed.Seconds(),
			thousands(o.load.sent), fmtMS(percentile(o.load.commitMS, 0.5)), fmtMS(percentile(o.load.commitMS, 0.99)), thousands(len(o.nats))), "", "info", o.usage)
	for _, q := range []struct {
		label, ref string
		p          float64
	}{{"p50", "reference 0.65 ms", 0.5}, {"p99", "reference 1.4 ms", 0.99}, {"p99.9", "—", 0.999}} {
		r.add(phase, "commit→decode "+q.label, fmtMS(percentile(o.nats, q.p)), q.ref, "floor", o.usage)
	}
	r.addCPU(phase, o.usage, "")
	return nil
}

// consumeFloor reads the stream, recording when each inserted event_key is
// decoded, and acknowledges what it received once a second.
func (e *env) consumeFloor(ctx context.Context, conn *pgconn.PgConn, t *tracker) error {
	keyCol := map[uint32]int{} // relation id → column of event_key
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
				case *pglogrepl.RelationMessage:
					for i, c := range lm.Columns {
						if c.Name == "event_key" {
							keyCol[lm.RelationID] = i
						}
					}
				case *pglogrepl.InsertMessage:
					if i, ok := keyCol[lm.RelationID]; ok && lm.Tuple != nil && i < len(lm.Tuple.Columns) {
						t.nats.record(t, string(lm.Tuple.Columns[i].Data), at)
					}
				}
			}
		}
	}
}
