package main

import (
	"context"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestNewPoolTurnsJITOff: the relay's connections run without JIT (a large
// batch would otherwise compile for half a second on the delivery path),
// unless the URL says otherwise.
func TestNewPoolTurnsJITOff(t *testing.T) {
	url := pgtest.NewDatabase(t)
	with := func(param string) string {
		if strings.Contains(url, "?") {
			return url + "&" + param
		}
		return url + "?" + param
	}
	ctx := context.Background()
	for _, tc := range []struct{ url, want string }{
		{url, "off"},
		{with("jit=on"), "on"},
		{with("options=-cjit%3Don"), "on"},
	} {
		pool, err := newPool(ctx, tc.url)
		if err != nil {
			t.Fatal(err)
		}
		var got string
		err = pool.QueryRow(ctx, "SHOW jit").Scan(&got)
		pool.Close()
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("%s: jit = %s, want %s", tc.url, got, tc.want)
		}
	}
}

// TestNewPoolFollowsWritableHost: with a multi-host URL whose first host is
// a standby and target_session_attrs=read-write, the pool connects to the
// primary (docs/failover.md).
func TestNewPoolFollowsWritableHost(t *testing.T) {
	ctx := context.Background()
	primary := pgtest.NewCluster(t, pgtest.Options{})
	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{})
	pool, err := newPool(ctx, pgtest.MultiHostURL("postgres", standby, primary))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var recovery bool
	var port int
	if err := pool.QueryRow(ctx, "SELECT pg_is_in_recovery(), inet_server_port()").Scan(&recovery, &port); err != nil {
		t.Fatal(err)
	}
	if recovery || port != primary.Port() {
		t.Errorf("pool connected to port %d (in recovery: %v), want the primary's %d", port, recovery, primary.Port())
	}
}
