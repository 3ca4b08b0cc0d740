package main

// Faults that are not crashes, one connection at a time: a black hole on
// the relay's replication connection alone, and on its leader lock
// connection alone (docs/operations-health.md, "Timeouts, fences and
// health"). The relays reach PostgreSQL through relay/netfault's proxy,
// which picks the connection by its StartupMessage.

import (
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// isReplicationConn picks a relay's replication connection.
var isReplicationConn = netfault.PostgresParam("replication", "database")

// isLeaderLockConn picks a relay's leader lock connection (ledger.AcquireLeader
// names it "outbox-relay leader <slot>").
var isLeaderLockConn = netfault.PostgresParam("application_name", "outbox-relay leader outbox_relay")

// startLogged runs the relay in this process, its log going to the test's
// log and to the returned buffer.
func (s *setup) startLogged(t *testing.T, cfgPath string) *syncBuffer {
	t.Helper()
	var buf syncBuffer
	log := zerolog.New(io.MultiWriter(zerolog.NewTestWriter(t), &buf)).Level(zerolog.InfoLevel).With().Timestamp().Logger()
	runInProcess(t, config.Options{Path: cfgPath}, log)
	return &buf
}

// checkDeliveries asserts that every repeat at either sink is the same
// event (same id and body) and that each sink saw every aggregate in order.
func (s *setup) checkDeliveries(t *testing.T) {
	t.Helper()
	for sink, ds := range map[string][]delivery{"webhook": s.hook.deliveries(), "nats": streamMessages(t, s.nats.URL())} {
		repeats := 0
		for key, copies := range byKey(ds) {
			for _, c := range copies[1:] {
				repeats++
				if c.Body != copies[0].Body || c.IdemKey != copies[0].IdemKey {
					t.Errorf("%s: repeat of %s with another id or body", sink, key)
				}
			}
		}
		t.Logf("%s: %d deliveries, %d repeats", sink, len(ds), repeats)
		checkOrder(t, sink, ds)
	}
}

var presumedDead = regexp.MustCompile(`no message from the server for ([0-9.]+m?s)`)

// TestBlackHole_ReplicationConnection: the replication connection alone
// turns into a black hole mid-stream while the leader lock and the pool
// work. The relay must notice within the receive limits
// (docs/operations-health.md: 5 s + 3 × the status interval between
// transactions, max(wal_sender_timeout, 10 s) within one), end its own
// stale walsender instead of waiting for the server's wal_sender_timeout,
// stream again over a new connection in the same leadership term, and lose
// nothing.
func TestBlackHole_ReplicationConnection(t *testing.T) {
	dbURL := pgtest.NewDatabase(t)
	s := newSetup(t, dbURL)
	pg, relayURL := netfault.ProxyURL(t, dbURL)
	s.url = relayURL
	logs := s.startLogged(t, s.configFile(t, ""))
	s.waitStreaming(t)

	var wg sync.WaitGroup
	wg.Go(func() { s.publishWritersPaced(t, 2, 2000, 20, "rbh", 4*time.Millisecond) })
	eventually(t, 20*time.Second, "deliveries before the fault", func() bool { return len(s.hook.deliveries()) >= 200 })

	old := s.walsenderPID(t)
	pg.BlackHoleConns(isReplicationConn, netfault.NewConnsPass)
	holed := time.Now()
	holedConns := 0
	for _, c := range pg.ConnInfos() {
		if c.BlackHoled {
			holedConns++
		}
	}
	if holedConns != 1 {
		t.Fatalf("%d connections black-holed, want the replication connection alone", holedConns)
	}

	eventually(t, 90*time.Second, "the relay to give the connection up", func() bool { return presumedDead.MatchString(logs.String()) })
	detected := time.Since(holed)
	silence := presumedDead.FindStringSubmatch(logs.String())[1]
	eventually(t, 90*time.Second, "the relay streaming over a new connection", func() bool {
		pid := s.walsenderPID(t)
		return pid != 0 && pid != old
	})
	resumed := time.Since(holed)
	t.Logf("replication connection black-holed: given up after %v (server silent for %s), streaming again after %v",
		detected.Round(time.Millisecond), silence, resumed.Round(time.Millisecond))

	// Mid-transaction the limit is max(wal_sender_timeout = 60 s, 10 s);
	// between transactions 5 s + 3 × 500 ms. A status interval and a
	// second of scheduling on top.
	if detected > 62*time.Second {
		t.Errorf("gave the connection up after %v, want at most 62 s", detected)
	}
	// Reconnecting takes a backoff (≤ 200 ms) and the fence of its own
	// stale walsender, not the server's wal_sender_timeout.
	if resumed-detected > 5*time.Second {
		t.Errorf("streaming again took %v after the connection was given up, want at most 5 s", resumed-detected)
	}
	if strings.Contains(logs.String(), "lost the leader lock") {
		t.Error("the leadership term ended: only the replication connection was black-holed")
	}

	wg.Wait()
	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 90*time.Second, keys)
	t.Logf("all %d events delivered %v after the fault", len(keys), time.Since(holed).Round(time.Millisecond))
	s.checkDeliveries(t)
}

var _ = fmt.Sprint
var _ = slices.Sort[[]int]
