package admin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// staleReply is how long a process may hold the slot without sending a
// standby status update before doctor calls it stale; a relay sends one at
// least every second.
const staleReply = 15 * time.Second

func (d *diagnosis) publication(ctx context.Context) {
	if !d.cfg.Replication {
		return
	}
	outbox := d.tables.Outbox
	if !d.exists[outbox] {
		d.add(Skip, "publication "+d.cfg.Publication, "the outbox table does not exist", "")
		return
	}
	pub := relay.QuoteIdentifier(d.cfg.Publication)
	var covers, all, inserts, others bool
	err := d.conn.QueryRow(ctx, catalogSQL("SlotPublication"), d.cfg.Publication, outbox.Quoted()).Scan(&covers, &all, &inserts, &others)
	name := "publication " + d.cfg.Publication
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		d.add(Fail, name, "does not exist: the stream path has nothing to stream",
			fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert');   -- as the table owner (outbox-relay migrate does this)", pub, outbox.Quoted()))
	case err != nil:
		d.add(Fail, name, fmt.Sprintf("read publication: %v", err), "")
	case !covers && !all:
		d.add(Fail, name, fmt.Sprintf("does not include %s", outbox),
			fmt.Sprintf("ALTER PUBLICATION %s ADD TABLE %s;   -- as the table owner", pub, outbox.Quoted()))
	case !inserts:
		d.add(Fail, name, "does not publish inserts", fmt.Sprintf("ALTER PUBLICATION %s SET (publish = 'insert');", pub))
	case all || others:
		d.add(Warn, name, "publishes more than the outbox's inserts (other tables or updates/deletes): the relay ignores them, but each is decoded and sent to it — every status UPDATE the relay makes comes back",
			fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert');   -- under a new name (source.publication), or ALTER PUBLICATION %s SET (publish = 'insert');",
				relay.QuoteIdentifier(d.cfg.Publication+"_outbox"), outbox.Quoted(), pub))
	default:
		d.add(OK, name, fmt.Sprintf("publishes inserts of %s", outbox), "")
	}
}

func (d *diagnosis) slot(ctx context.Context) {
	var (
		slotType, plugin, database, walStatus, app, client string
		invalidation                                       string
		sameDB, active                                     bool
		pid                                                int32
		retained                                           *int64
		backendStart                                       *time.Time
		replyAge                                           *float64
	)
	err := d.conn.QueryRow(ctx, catalogSQL("SlotState"), d.cfg.Slot).Scan(&slotType, &plugin, &database, &sameDB, &walStatus, &invalidation, &active, &pid,
		&retained, &app, &backendStart, &client, &replyAge)
	name := "slot " + d.cfg.Slot
	drop := fmt.Sprintf("SELECT pg_drop_replication_slot(%s);", relay.QuoteLiteral(d.cfg.Slot))
	switch {
	case errors.Is(err, pgx.ErrNoRows) && d.cfg.Replication:
		d.add(OK, name, "does not exist yet: run creates it, handing the rows pending at that moment to the claim path", "")
		return
	case errors.Is(err, pgx.ErrNoRows):
		return
	case err != nil:
		fix := ""
		if classifyRefusal(err) != refusalUnknown { // Aurora refuses pg_current_wal_lsn() below wal_level logical
			fix, _ = RefusalFix(d.provider, d.role.name, d.host, err)
		}
		d.add(Fail, name, fmt.Sprintf("read pg_replication_slots: %v", err), fix)
		return
	}
	if !d.cfg.Replication {
		if !active {
			d.add(Warn, name, fmt.Sprintf("exists, but source.mode poll never consumes it: it retains %s of WAL and keeps growing", formatRetained(retained)), drop)
		}
		return
	}
	holder := fmt.Sprintf("pid %d (application_name %q", pid, app)
	if client != "" {
		holder += ", from " + client
	}
	if backendStart != nil {
		holder += ", since " + backendStart.UTC().Format(time.RFC3339)
	}
	holder += ")"
	terminate := fmt.Sprintf("SELECT pg_terminate_backend(%d);", pid)

	switch {
	case slotType != "logical":
		d.add(Fail, name, fmt.Sprintf("is a %s slot, not the relay's", slotType), "set source.slot to another name, or drop it: "+drop)
	case !sameDB:
		d.add(Fail, name, fmt.Sprintf("belongs to database %q", database), "set source.slot to another name")
	case plugin != "pgoutput":
		d.add(Fail, name, fmt.Sprintf("uses plugin %q, not pgoutput", plugin), "set source.slot to another name, or drop it: "+drop)
	case walStatus == "lost" || invalidation != "":
		d.add(Warn, name, fmt.Sprintf("was invalidated (%s); run drops and recreates it, and the claim path delivers the rows in between", invalidationCause(walStatus, invalidation)),
			"nothing is required; to drop it now: "+drop)
	case active && replyAge != nil && *replyAge > staleReply.Seconds():
		d.add(Fail, name, fmt.Sprintf("held by %s, which has sent no status for %.0fs: a stale process keeps the relay from streaming", holder, *replyAge), terminate)
	case active && !strings.HasPrefix(app, "outbox-relay"):
		d.add(Warn, name, fmt.Sprintf("held by %s, which is not outbox-relay: the relay cannot stream while it does", holder),
			"if that process should not consume the relay's slot: "+terminate)
	case active:
		d.add(OK, name, fmt.Sprintf("streaming to %s; if no relay should be running, end it: %s", holder, terminate), "")
	case walStatus == "unreserved":
		d.add(Warn, name, "retains more WAL than max_slot_wal_keep_size (wal_status unreserved): it is invalidated unless a relay consumes it soon",
			"start the relay (outbox-relay run); or, if it is no longer used: "+drop)
	default:
		d.add(OK, name, fmt.Sprintf("exists (wal_status %s), not in use: run resumes from it", walStatus), "")
	}

	if slotType == "logical" && sameDB && plugin == "pgoutput" && walStatus != "lost" && invalidation == "" {
		d.handOver(ctx)
	}

	if retained == nil {
		return
	}
	limit := d.cfg.SlotMaxRetained
	if limit > 0 && *retained > limit {
		d.add(Warn, "retained WAL", fmt.Sprintf("the slot retains %s, more than source.slot_max_retained (%s): run drops a slot it owns but cannot consume past that", FormatBytes(*retained), FormatBytes(limit)),
			"start the relay, or if it cannot catch up: "+drop)
		return
	}
	d.add(OK, "retained WAL", fmt.Sprintf("%s (source.slot_max_retained %s)", FormatBytes(*retained), FormatBytes(limit)), "")
}

// handOver reports whether the relay recorded the hand-over of the slot
// (docs/failover.md, "A slot without its hand-over record"): without it,
// run keeps the safe rule and hands every pending row to the claim path,
// and says how many and for about how long.
func (d *diagnosis) handOver(ctx context.Context) {
	t := d.tables
	if !d.exists[t.Checkpoint] || !d.exists[t.Outbox] {
		return
	}
	const name = "slot hand-over"
	var recorded bool
	err := d.conn.QueryRow(ctx, t.sql("SlotHandOverRecorded"), d.cfg.Slot).Scan(&recorded)
	if err != nil {
		d.add(Fail, name, fmt.Sprintf("read %s: %v", t.Checkpoint, err), "")
		return
	}
	if recorded {
		d.add(OK, name, "recorded: the relay made this slot and delivered the rows pending then", "")
		return
	}
	var pending int64
	if err := d.conn.QueryRow(ctx, t.sql("SlotStreamOwnedRows")).Scan(&pending); err != nil {
		d.add(Fail, name, fmt.Sprintf("count the pending rows of %s: %v", t.Outbox, err), "")
		return
	}
	d.add(Warn, name, fmt.Sprintf("no record of the relay's hand-over for this slot (another process made it, or the relay stopped while making it): "+
		"rows committed behind it may never be streamed, so run keeps the safe rule — it drops the slot, makes it again and delivers the rows pending then "+
		"beside the stream, each aggregate's before its new events: %s rows now (those the ledger shows delivered are skipped), about %s at %s rows/s",
		humanCount(pending), relay.HandOverDrainEstimate(pending), humanCount(relay.HandOverRowsPerSecond)),
		`nothing is required (docs/failover.md, "A slot without its hand-over record"); to stream from the slot's position instead, let the relay create its slot`)
}

// humanCount formats n with comma separators.
func humanCount[T int | int64](n T) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0 && s[i-1] != '-'; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// invalidationCause explains why the server invalidated a slot, from its
// wal_status and invalidation_reason (17+; "" before).
func invalidationCause(walStatus, reason string) string {
	switch reason {
	case "", "wal_removed":
		return "wal_status " + walStatus + ": it fell further behind than max_slot_wal_keep_size"
	case "idle_timeout":
		return "invalidation_reason idle_timeout: no one used it for longer than idle_replication_slot_timeout"
	case "wal_level_insufficient":
		return "invalidation_reason wal_level_insufficient: wal_level was set below logical"
	case "rows_removed":
		return "invalidation_reason rows_removed: rows it still needed were vacuumed away"
	}
	return "invalidation_reason " + reason
}

func formatRetained(b *int64) string {
	if b == nil {
		return "an unknown amount"
	}
	return FormatBytes(*b)
}

// recommendedKeepSize is the max_slot_wal_keep_size doctor suggests: ten
// times the relay's own limit, and at least 10 GiB.
func recommendedKeepSize(slotMaxRetained int64) int64 {
	return max(10<<30, 10*slotMaxRetained)
}

func (d *diagnosis) maxSlotWALKeepSize(ctx context.Context) {
	d.keepSize(ctx, d.conn, "max_slot_wal_keep_size", "")
}

// keepSize checks max_slot_wal_keep_size on the server conn is connected
// to: the primary, or (check name "standby max_slot_wal_keep_size", fixes
// prefixed "on the standby: ") the standby the relay's slot lives on.
func (d *diagnosis) keepSize(ctx context.Context, conn *pgx.Conn, name, on string) {
	var mb int64
	if err := conn.QueryRow(ctx, catalogSQL("SlotMaxWALKeepSize")).Scan(&mb); err != nil {
		d.add(Fail, name, fmt.Sprintf("read setting: %v", err), "")
		return
	}
	if mb >= 0 {
		d.add(OK, name, FormatBytes(mb<<20), "")
		return
	}
	rec := recommendedKeepSize(d.cfg.SlotMaxRetained)
	fix := fmt.Sprintf("ALTER SYSTEM SET max_slot_wal_keep_size = '%dGB';   -- well above the relay's slot_max_retained, well below the free space of pg_wal's disk\nSELECT pg_reload_conf();", rec>>30)
	if d.provider != SelfManaged {
		fix = SettingFix(d.provider, "max_slot_wal_keep_size", sizeSetting(d.provider, rec>>30), false) + "   -- in MB when a plain number; well above the relay's slot_max_retained, well below the storage left for WAL"
	}
	server := "the primary stops"
	if on != "" {
		fix = on + fix
		server = "the standby stops"
	}
	d.add(Warn, name,
		"-1 (unlimited): a slot no one consumes keeps all WAL from its position on, until pg_wal fills the disk and "+server+". "+
			"A running relay drops a slot it cannot consume (source.slot_max_unconsumed), but a relay that is down cannot. "+
			"With a limit the server invalidates such a slot instead; the relay recreates it and the claim path delivers the rows in between",
		fix)
}

// shortIdleSlotTimeout is the idle_replication_slot_timeout below which
// doctor warns: a relay restart or an HA takeover can leave the slot unused
// for that long.
const shortIdleSlotTimeout = 10 * time.Minute

// idleSlotTimeout reports idle_replication_slot_timeout (PostgreSQL 18+; on
// older servers there is nothing to report).
func (d *diagnosis) idleSlotTimeout(ctx context.Context) {
	if !d.cfg.Replication {
		return
	}
	var seconds int64
	err := d.conn.QueryRow(ctx, catalogSQL("SlotIdleTimeout")).Scan(&seconds)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return
	case err != nil:
		d.add(Fail, "idle_replication_slot_timeout", fmt.Sprintf("read setting: %v", err), "")
		return
	}
	timeout := time.Duration(seconds) * time.Second
	switch {
	case seconds == 0:
		d.add(OK, "idle_replication_slot_timeout", "0 (slots are not invalidated for being unused)", "")
	case timeout < shortIdleSlotTimeout:
		d.add(Warn, "idle_replication_slot_timeout",
			fmt.Sprintf("%s: a relay restart or HA takeover that leaves the slot unused that long (until the next checkpoint) loses it; run recreates it and the claim path delivers the rows in between, more slowly than the stream", timeout),
			idleTimeoutFix(d.provider))
	default:
		d.add(OK, "idle_replication_slot_timeout", fmt.Sprintf("%s: a relay down longer than that loses its slot; run recreates it and the claim path delivers the rows in between", timeout), "")
	}
}

func idleTimeoutFix(p Provider) string {
	if p != SelfManaged {
		return SettingFix(p, "idle_replication_slot_timeout", durationSetting(p, 3600), false) + "   -- one hour (in seconds when a plain number): longer than any relay downtime you plan for"
	}
	return "ALTER SYSTEM SET idle_replication_slot_timeout = '1h';   -- longer than any relay downtime you plan for\nSELECT pg_reload_conf();"
}

// FormatBytes prints n bytes with a binary unit ("12.3 MiB").
func FormatBytes(n int64) string {
	const unit = 1024
	if n < unit && n > -unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit || m <= -unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
