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

// notifyHorizon is the notifier's horizon: the start of the oldest
// transaction of the relay's role open in this database, or now. A row is
// dead-lettered or held by the relay with processed_at = now(), its
// transaction's start, and commits later: a row settled before the horizon
// belongs to a transaction that has ended, and a statement run after this
// one sees it. Only the relay's role settles rows, so the applications'
// transactions (however long) do not hold the horizon back; walsenders and
// autovacuum are not client backends.
const notifyHorizon = `
SELECT coalesce(min(a.xact_start), now()) AS at
  FROM pg_stat_activity AS a
 WHERE a.datname = current_database() AND a.usename = current_user
   AND a.backend_type = 'client backend' AND a.xact_start IS NOT NULL`

func newNotifySQL(outbox, state relay.QualifiedName) notifySQL {
	o, s := outbox.Quoted(), state.Quoted()
	return notifySQL{
		horizon: notifyHorizon,

		// A channel seen for the first time starts at the horizon. The
		// insert's rows are not visible to the statement's own SELECT, so
		// each channel comes from one side of the UNION.
		marks: fmt.Sprintf(`
WITH h AS (%[2]s),
added AS (
INSERT INTO %[1]s AS s (channel, notified_at, notified_id)
SELECT c, h.at, 0 FROM unnest($1::text[]) AS c, h
    ON CONFLICT (channel) DO NOTHING
RETURNING s.channel, s.notified_at, s.notified_id)
SELECT channel, notified_at, notified_id FROM added
UNION ALL
SELECT channel, notified_at, notified_id FROM %[1]s WHERE channel = ANY($1::text[])`, s, notifyHorizon),

		// The status list and the order repeat the dead-letter index's
		// predicate and columns (migration 015).
		read: fmt.Sprintf(`
SELECT o.id, o.processed_at, o.event_key, o.status, coalesce(o.last_error, '')
  FROM %s AS o
 WHERE o.status IN ('failed', 'held')
   AND (o.processed_at, o.id) > ($1::timestamptz, $2::bigint)
   AND o.processed_at < $3::timestamptz
 ORDER BY o.processed_at, o.id
 LIMIT $4`, o),

		// Only while the mark is the one the caller read, and no relay
		// attempted a notification of the channel in the last interval.
		claim: fmt.Sprintf(`
UPDATE %s
   SET attempted_at = now(), attempted_by = $5
 WHERE channel = $1 AND notified_at = $2 AND notified_id = $3
   AND (attempted_at IS NULL OR attempted_at <= now() - $4::bigint * interval '1 microsecond')
RETURNING attempted_at`, s),

		// A mark never moves back.
		record: fmt.Sprintf(`
UPDATE %s
   SET notified_at = CASE WHEN (notified_at, notified_id) < ($4::timestamptz, $5::bigint) THEN $4 ELSE notified_at END,
       notified_id = CASE WHEN (notified_at, notified_id) < ($4::timestamptz, $5::bigint) THEN $5 ELSE notified_id END,
       sent_at = now()
 WHERE channel = $1 AND attempted_by = $2 AND attempted_at = $3`, s),

		pass: fmt.Sprintf(`
UPDATE %s SET notified_at = $2, notified_id = $3
 WHERE channel = ANY($1::text[]) AND (notified_at, notified_id) < ($2::timestamptz, $3::bigint)`, s),
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
	err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, current_user,
		coalesce(has_table_privilege(to_regclass($1), 'SELECT')
		     AND has_table_privilege(to_regclass($1), 'INSERT')
		     AND has_table_privilege(to_regclass($1), 'UPDATE'), false)`, state.Quoted()).Scan(&exists, &role, &allowed)
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
	return &NotifyStore{db: db, owner: owner, q: newNotifySQL(outbox, state)}, nil
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
