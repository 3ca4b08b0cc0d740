package admin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/notify"
)

// NotifyStore is the dead-letter notifier's store (notify.Store): the
// outbox's failed and held rows, read in the order they were settled
// (processed_at, then id) through the partial index of migration 015, and
// the marks in the notify table beside the outbox
// (docs/operations.md, "Dead-letter notifications").
type NotifyStore struct {
	db    DB
	owner string
	q     notifySQL
}

var _ notify.Store = (*NotifyStore)(nil)

// notifySQL are the notifier's statements, rendered once for the tables.
type notifySQL struct {
	horizon, marks, read, claim, record, pass string
}

func newNotifySQL(outbox relay.QualifiedName) notifySQL {
	return notifySQL{
		horizon: outboxSQL(outbox, "NotifyHorizon"),
		marks:   outboxSQL(outbox, "NotifyMarks"),
		read:    outboxSQL(outbox, "NotifyRead"),
		claim:   outboxSQL(outbox, "NotifyClaim"),
		record:  outboxSQL(outbox, "NotifyRecord"),
		pass:    outboxSQL(outbox, "NotifyPass"),
	}
}

// NewNotifyStore returns the notifier's store on outbox (schema-qualified,
// as Resolve returns it) for the relay owner. It fails, naming the fix,
// when migrate has not created the notify table or the role may not read
// and write it.
func NewNotifyStore(ctx context.Context, db DB, outbox relay.QualifiedName, owner string) (*NotifyStore, error) {
	state := migrations.NotifyStateTable(outbox)
	var exists, allowed bool
	var role string
	err := db.QueryRow(ctx, catalogSQL("NotifyTableAccess"), state.Quoted()).Scan(&exists, &role, &allowed)
	if err != nil {
		return nil, fmt.Errorf("notify: look up %s: %w", state, err)
	}
	if !exists {
		return nil, fmt.Errorf("notify: table %s does not exist: run outbox-relay migrate", state)
	}
	if !allowed {
		return nil, &PrivilegeError{Role: role, Lacks: []string{"SELECT, INSERT, UPDATE on " + state.String() + " (for notify)"},
			Fix: []string{fmt.Sprintf("GRANT SELECT, INSERT, UPDATE ON %s TO %s;", state.Quoted(), relay.QuoteIdentifier(role))}}
	}
	return &NotifyStore{db: db, owner: owner, q: newNotifySQL(outbox)}, nil
}

// Marks returns each channel's mark, creating the missing ones at the
// horizon (notify.Store).
func (s *NotifyStore) Marks(ctx context.Context, channels []string) (map[string]notify.Mark, error) {
	rows, err := s.db.Query(ctx, s.q.marks, channels)
	if err != nil {
		return nil, err
	}
	out := make(map[string]notify.Mark, len(channels))
	var ch string
	var m notify.Mark
	_, err = pgx.ForEachRow(rows, []any{&ch, &m.At, &m.ID}, func() error {
		out[ch] = m
		return nil
	})
	return out, err
}

// Read reads the dead letters after from that were settled before the
// horizon, in mark order, at most limit (notify.Store). The horizon is read
// first, in its own statement, so that the rows before it are all visible
// to the read that follows.
func (s *NotifyStore) Read(ctx context.Context, from notify.Mark, limit int, each func(notify.DeadLetter)) (int, error) {
	var horizon time.Time
	if err := s.db.QueryRow(ctx, s.q.horizon).Scan(&horizon); err != nil {
		return 0, fmt.Errorf("read the horizon: %w", err)
	}
	rows, err := s.db.Query(ctx, s.q.read, from.At, from.ID, horizon, limit)
	if err != nil {
		return 0, err
	}
	var d notify.DeadLetter
	n := 0
	_, err = pgx.ForEachRow(rows, []any{&d.ID, &d.At, &d.EventKey, &d.Status, &d.LastError}, func() error {
		n++
		each(d)
		return nil
	})
	return n, err
}

// Claim takes channel's next notification for this relay (notify.Store).
func (s *NotifyStore) Claim(ctx context.Context, channel string, from notify.Mark, every time.Duration) (notify.Claim, bool, error) {
	c := notify.Claim{Channel: channel}
	err := s.db.QueryRow(ctx, s.q.claim, channel, from.At, from.ID, every.Microseconds(), s.owner).Scan(&c.At)
	if errors.Is(err, pgx.ErrNoRows) {
		return c, false, nil
	}
	return c, err == nil, err
}

// Record moves the claimed channel's mark to to (notify.Store).
func (s *NotifyStore) Record(ctx context.Context, c notify.Claim, to notify.Mark) (bool, error) {
	tag, err := s.db.Exec(ctx, s.q.record, c.Channel, s.owner, c.At, to.At, to.ID)
	return err == nil && tag.RowsAffected() == 1, err
}

// Pass moves the marks of channels that are before to up to to
// (notify.Store).
func (s *NotifyStore) Pass(ctx context.Context, channels []string, to notify.Mark) error {
	_, err := s.db.Exec(ctx, s.q.pass, channels, to.At, to.ID)
	return err
}
