package admin

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/relay"
)

// CheckStatus is the outcome of one doctor check.
type CheckStatus string

// Check outcomes. Only Fail makes doctor exit non-zero.
const (
	OK   CheckStatus = "ok"
	Warn CheckStatus = "warn"
	Fail CheckStatus = "FAIL"
	Skip CheckStatus = "skip"
)

// Check is one doctor finding. Fix, for Warn and Fail, is the exact
// statement or setting that resolves it.
type Check struct {
	Name   string      `json:"name"`
	Status CheckStatus `json:"status"`
	Detail string      `json:"detail"`
	Fix    string      `json:"fix,omitempty"`
}

// DiagnoseConfig says what Diagnose checks.
type DiagnoseConfig struct {
	// ConnString is the relay's database_url.
	ConnString string
	// ConnectTimeout bounds each connection attempt [10s].
	ConnectTimeout time.Duration
	Tables         Tables
	Publication    string
	Slot           string
	// Replication is true unless source.mode is poll: the stream path then
	// needs wal_level logical, the REPLICATION attribute, the publication
	// and the slot.
	Replication bool
	// ReplicationRequired is true in source.mode replication, which does
	// not start without the stream path. In auto mode the relay polls
	// while replication is impossible, so wal_level below logical is a
	// warning there, not a failure.
	ReplicationRequired bool
	// NotifyTrigger is source.notify_trigger and PollInterval
	// source.poll_interval: how the claim path learns of new rows while
	// the relay polls.
	NotifyTrigger bool
	PollInterval  time.Duration
	// Retention is retention.enabled: run then deletes done rows and needs
	// DELETE on the outbox.
	Retention bool
	// SlotMaxRetained is source.slot_max_retained, in bytes.
	SlotMaxRetained int64
	// StandbyURL is source.standby_url: the relay decodes on that
	// standby, whose checks replace the slot's on the primary
	// (doctor_standby.go). StandbyMaxLag is source.standby_max_lag.
	StandbyURL    string
	StandbyMaxLag time.Duration
}

// Diagnose checks the database side of a relay: the connection, the server
// version, that it is a primary, wal_level (in auto mode below logical a
// warning: the relay polls there), the role's REPLICATION attribute and a
// replication connection, the schema version, the privileges the run role
// needs and those it has beyond them, the publication, while the relay
// polls the notify trigger (source.notify_trigger), the slot (state,
// holder, retained WAL), max_slot_wal_keep_size, (18+)
// idle_replication_slot_timeout, the settings that bound how long a
// vanished or cut-off relay's sessions outlive it (wal_sender_timeout, TCP
// keepalives, idle_session_timeout, idle_in_transaction_session_timeout;
// docs/operations-health.md) and, when physical standbys exist, what a
// failover to one needs (failover.go), or with StandbyURL what decoding on
// that standby needs (doctor_standby.go). On a managed service it recognises
// (DetectProvider) the fixes are that service's. It connects as the relay
// would, only reads, and reports every problem it finds with its fix; it
// never returns an error of its own.
func Diagnose(ctx context.Context, cfg DiagnoseConfig) []Check {
	if cfg.ConnectTimeout <= 0 {
		cfg.ConnectTimeout = 10 * time.Second
	}
	d := &diagnosis{cfg: cfg}
	if cc, err := pgconn.ParseConfig(cfg.ConnString); err == nil {
		d.host, d.user = cc.Host, cc.User
	}
	// Before connecting, only the host name can tell the provider.
	d.provider = DetectProvider(ServerMarkers{Host: d.host})
	conn, err := d.connect(ctx)
	if err != nil {
		fix := "check database_url (or --database-url, DATABASE_URL, the PG* variables), that the server is up and that pg_hba.conf admits this role from this host"
		// An ordinary connection: a pooler's host alone says nothing.
		if classifyRefusal(err) != refusalUnknown {
			fix, _ = RefusalFix(d.provider, d.user, d.host, err)
		}
		d.add(Fail, "connection", fmt.Sprintf("cannot connect: %v", err), fix)
		return d.checks
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	d.conn = conn
	if !d.server(ctx) {
		return d.checks
	}
	d.detectProvider(ctx)
	d.walLevel(ctx)
	if !d.readRole(ctx) {
		return d.checks
	}
	d.replicationAttribute()
	d.replicationConnection(ctx)
	if d.schema(ctx) {
		d.privileges(ctx)
	}
	d.extraPrivileges()
	d.publication(ctx)
	d.notifyTrigger(ctx)
	onStandby := d.cfg.Replication && d.cfg.StandbyURL != ""
	if onStandby {
		d.standby(ctx)
	} else {
		d.slot(ctx)
	}
	d.maxSlotWALKeepSize(ctx)
	d.idleSlotTimeout(ctx)
	d.walSenderTimeout(ctx)
	d.vanishedSessions(ctx)
	d.idleSessionTimeout(ctx)
	if !onStandby {
		// Decoding on a standby, the slot is on the server a failover
		// promotes (docs/standby.md).
		d.failover(ctx)
	}
	return d.checks
}

type diagnosis struct {
	cfg    DiagnoseConfig
	conn   *pgx.Conn
	checks []Check

	// From the server and the role.
	walLevelSetting string
	version         int // server_version_num
	role            roleInfo
	// host and user are database_url's; provider is the managed service
	// the server belongs to (SelfManaged if none).
	host, user string
	provider   Provider
	// tables are the configured tables, schema-qualified when they exist.
	tables Tables
	exists map[relay.QualifiedName]bool
	// privs are the privileges on each existing table, by name.
	privs []tablePrivileges
}

func (d *diagnosis) add(status CheckStatus, name, detail, fix string) {
	d.checks = append(d.checks, Check{Name: name, Status: status, Detail: detail, Fix: fix})
}
