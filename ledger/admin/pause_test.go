package admin_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
)

// TestPauseSink: a pause is one row that every reader sees (the engine's
// PauseReader, the list status shows); a second pause keeps the first;
// resume removes it; an unknown sink is an error naming the configured
// ones and writes nothing.
func TestPauseSink(t *testing.T) {
	for name, names := range map[string]migrations.Names{"default names": migrations.DefaultNames(), "hostile names": hostileNames()} {
		t.Run(name, func(t *testing.T) {
			f := MustFixtureNames(t, names)
			ctx := context.Background()
			tables := f.tables
			tables.Sinks = []admin.Sink{{Name: "n8n"}, {Name: "nats"}}
			reader := admin.NewPauseReader(f.pool, tables.Outbox)

			p, already, err := admin.PauseSink(ctx, f.pool, tables, "n8n", "n8n upgrade", "ops@host")
			if err != nil || already || p.Sink != "n8n" || p.Reason != "n8n upgrade" || p.PausedBy != "ops@host" || p.PausedAt.IsZero() {
				t.Fatalf("pause: %+v already=%v %v", p, already, err)
			}
			again, already, err := admin.PauseSink(ctx, f.pool, tables, "n8n", "other", "someone")
			if err != nil || !already || again.Reason != "n8n upgrade" || !again.PausedAt.Equal(p.PausedAt) {
				t.Fatalf("second pause: %+v already=%v %v, want the first kept", again, already, err)
			}
			if names, err := reader.PausedSinks(ctx); err != nil || !slices.Equal(names, []string{"n8n"}) {
				t.Fatalf("PausedSinks: %v %v", names, err)
			}
			if list, err := admin.Pauses(ctx, f.pool, tables.Outbox); err != nil || len(list) != 1 || list[0].Reason != "n8n upgrade" {
				t.Fatalf("Pauses: %+v %v", list, err)
			}

			if _, _, err := admin.PauseSink(ctx, f.pool, tables, "nope", "", ""); !errors.Is(err, admin.ErrNoSuchSink) || err.Error() != `no such sink "nope" (configured: n8n, nats)` {
				t.Fatalf("unknown sink: %v", err)
			}
			if _, _, err := admin.ResumeSink(ctx, f.pool, tables, "nope"); !errors.Is(err, admin.ErrNoSuchSink) {
				t.Fatalf("resume an unknown sink: %v", err)
			}

			since, was, err := admin.ResumeSink(ctx, f.pool, tables, "n8n")
			if err != nil || !was || !since.Equal(p.PausedAt) {
				t.Fatalf("resume: since %v was=%v %v", since, was, err)
			}
			if _, was, err := admin.ResumeSink(ctx, f.pool, tables, "n8n"); err != nil || was {
				t.Fatalf("second resume: was=%v %v, want nothing to do", was, err)
			}
			if names, err := reader.PausedSinks(ctx); err != nil || len(names) != 0 {
				t.Fatalf("PausedSinks after resume: %v %v", names, err)
			}
		})
	}
}

// TestPauseSink_NoTable: before migrate has made the pauses table, the
// error says to run it.
func TestPauseSink_NoTable(t *testing.T) {
	f := MustFixture(t)
	MustExec(t, f.pool, "DROP TABLE "+migrations.SinkPausesTable(f.tables.Outbox).Quoted())
	tables := f.tables
	tables.Sinks = []admin.Sink{{Name: "n8n"}}
	_, _, err := admin.PauseSink(context.Background(), f.pool, tables, "n8n", "", "")
	if err == nil || !strings.Contains(err.Error(), "run outbox-relay migrate") {
		t.Fatalf("pause without the table: %v", err)
	}
}
