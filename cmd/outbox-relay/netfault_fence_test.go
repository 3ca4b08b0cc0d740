package main

// Faults that are not crashes, one connection at a time: a black hole on
// the relay's replication connection alone, and on its leader lock
// connection alone (docs/operations-health.md, "Timeouts, fences and
// health"). The relays reach PostgreSQL through relay/netfault's proxy,
// which picks the connection by its StartupMessage.

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
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

// presumedDead matches the relay's give-up line; its silence is a Go
// duration, which reads "1m0.045s" from a minute on (the mid-transaction
// limit is wal_sender_timeout, 60 s by default).
var presumedDead = regexp.MustCompile(`no message from the server for ((?:[0-9.]+[hm])*[0-9.]+m?s)`)

// TestPresumedDeadMatchesEverySilence: CI's black-hole run gave the
// connection up after 1m0.045s and the old pattern ([0-9.]+m?s) missed it.
func TestPresumedDeadMatchesEverySilence(t *testing.T) {
	for _, d := range []time.Duration{6500 * time.Millisecond, 900 * time.Millisecond, 60045 * time.Millisecond, 61 * time.Minute} {
		line := "receive: no message from the server for " + d.String() + ": the connection is presumed dead"
		m := presumedDead.FindStringSubmatch(line)
		if m == nil || m[1] != d.String() {
			t.Errorf("%q: matched %q, want %s", line, m, d)
		}
	}
}

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

// relayConfig writes a config file for relay name, which reaches
// PostgreSQL at url and marks its webhook requests X-Test-Relay: name.
func (s *setup) relayConfig(t *testing.T, name, url string) string {
	t.Helper()
	direct := s.url
	s.url = url
	defer func() { s.url = direct }()
	path := filepath.Join(s.dir, "relay-"+name+".yaml")
	if err := os.Rename(s.configFile(t, "    headers: {X-Test-Relay: "+name+"}"), path); err != nil {
		t.Fatal(err)
	}
	return path
}

// deliveryRun is a stretch of webhook deliveries by one relay with no pause
// longer than runGap.
type deliveryRun struct {
	from        string
	first, last time.Time
	n           int
}

// runGap splits one relay's deliveries into runs: under the tests' load a
// leader delivers every few milliseconds, and a takeover pauses for seconds.
const runGap = 2 * time.Second

// deliveryRuns splits the deliveries made after since into runs per relay,
// ordered by their first delivery.
func deliveryRuns(ds []delivery, since time.Time) []deliveryRun {
	byRelay := map[string][]time.Time{}
	for _, d := range ds {
		if !d.At.Before(since) {
			byRelay[d.From] = append(byRelay[d.From], d.At)
		}
	}
	var runs []deliveryRun
	for from, ats := range byRelay {
		slices.SortFunc(ats, func(a, b time.Time) int { return a.Compare(b) })
		run := deliveryRun{from: from, first: ats[0], last: ats[0], n: 1}
		for _, at := range ats[1:] {
			if at.Sub(run.last) > runGap {
				runs = append(runs, run)
				run = deliveryRun{from: from, first: at}
			}
			run.last = at
			run.n++
		}
		runs = append(runs, run)
	}
	slices.SortFunc(runs, func(a, b deliveryRun) int { return a.first.Compare(b.first) })
	return runs
}

// bothDelivered is how long two relays delivered at once — the total
// overlap of runs of different relays — and how many pairs of such runs
// overlap at all (a single delivery inside another relay's run counts,
// though it adds no time).
func bothDelivered(runs []deliveryRun) (overlap time.Duration, pairs int) {
	for i, a := range runs {
		for _, b := range runs[i+1:] {
			// Runs are ordered by first: b starts within a, or after it.
			if a.from == b.from || b.first.After(a.last) {
				continue
			}
			pairs++
			end := a.last
			if b.last.Before(end) {
				end = b.last
			}
			overlap += end.Sub(b.first)
		}
	}
	return overlap, pairs
}

func describeRuns(runs []deliveryRun, since time.Time) string {
	var parts []string
	for _, r := range runs {
		parts = append(parts, fmt.Sprintf("%s %d deliveries from %+.3fs to %+.3fs", r.from, r.n, r.first.Sub(since).Seconds(), r.last.Sub(since).Seconds()))
	}
	return strings.Join(parts, "; ")
}

// twoRelays starts relay A, waits until it streams, then relay B, and waits
// until B stands by. Each reaches PostgreSQL through its own proxy.
func (s *setup) twoRelays(t *testing.T) (pgA *netfault.Proxy, logA, logB *syncBuffer) {
	t.Helper()
	direct := s.url
	pgA, urlA := netfault.ProxyURL(t, direct)
	_, urlB := netfault.ProxyURL(t, direct)
	logA, logB = &syncBuffer{}, &syncBuffer{}
	s.startProcess(t, s.relayConfig(t, "A", urlA), logA)
	s.waitSlot(t)
	s.startProcess(t, s.relayConfig(t, "B", urlB), logB)
	eventually(t, 20*time.Second, "relay B standing by", func() bool { return strings.Contains(logB.String(), "standing by") })
	return pgA, logA, logB
}

// logTime returns the time of the first line of a JSON log that contains
// msg, or the zero time.
func logTime(t *testing.T, log, msg string) time.Time {
	t.Helper()
	for line := range strings.Lines(log) {
		if !strings.Contains(line, msg) {
			continue
		}
		m := regexp.MustCompile(`"time":"([^"]+)"`).FindStringSubmatch(line)
		if m == nil {
			continue
		}
		at, err := time.Parse(time.RFC3339, m[1])
		if err != nil {
			t.Fatalf("log time %q: %v", m[1], err)
		}
		return at
	}
	return time.Time{}
}

// TestBlackHole_LeaderLockPath: the leader's lock connection — and every
// lock connection it opens afterwards — is black-holed while its pool
// works, with a second relay standing by; in the second case its
// replication connection too, so the server keeps its walsender. The
// leader's ping fails and it stops delivering (ping 1 s + timeout 2 s, then
// a drain of 1 s); the standby ends the leader's lock session once it has
// been idle for LeaderStaleAfter (10 s), takes over, ends the old
// walsender if the server still has it, and delivers everything. The two
// never deliver at once: the receiver tells them apart by a header each
// relay's sink sets.
func TestBlackHole_LeaderLockPath(t *testing.T) {
	for _, tc := range []struct {
		name      string
		match     func(netfault.ConnInfo) bool
		oldSender bool // the server keeps A's walsender: B must end it
	}{
		{"lock", isLeaderLockConn, false},
		{"lock and replication", func(c netfault.ConnInfo) bool { return isLeaderLockConn(c) || isReplicationConn(c) }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSetup(t, pgtest.NewDatabase(t))
			pgA, logA, logB := s.twoRelays(t)

			var wg sync.WaitGroup
			wg.Go(func() { s.publishWritersPaced(t, 2, 4000, 20, "lbh", 4*time.Millisecond) })
			eventually(t, 20*time.Second, "deliveries before the fault", func() bool { return len(s.hook.deliveries()) >= 200 })

			oldSender := s.walsenderPID(t)
			pgA.BlackHoleConns(tc.match, netfault.NewConnsBlackHole)
			holed := time.Now()
			eventually(t, 30*time.Second, "relay B leading", func() bool { return strings.Contains(logB.String(), "leader for the slot") })
			eventually(t, 30*time.Second, "relay B streaming", func() bool {
				pid := s.walsenderPID(t)
				return pid != 0 && pid != oldSender
			})
			streaming := time.Since(holed)
			wg.Wait()
			keys := s.keys(t, "true")
			s.waitAllDelivered(t, 90*time.Second, keys)

			stepDown := logTime(t, logA.String(), "lost the leader lock")
			takeOver := logTime(t, logB.String(), "leader for the slot")
			if stepDown.IsZero() {
				t.Fatal("relay A never logged the lost leader lock")
			}
			ended := strings.Contains(logB.String(), "ended a stale walsender")
			if ended != tc.oldSender {
				t.Errorf("relay B ended a stale walsender: %v, want %v", ended, tc.oldSender)
			}
			runs := deliveryRuns(s.hook.deliveries(), holed.Add(-time.Second))
			overlap, pairs := bothDelivered(runs)
			var lastA, firstB time.Time
			for _, r := range runs {
				if r.from == "A" && r.last.After(lastA) {
					lastA = r.last
				}
				if r.from == "B" && (firstB.IsZero() || r.first.Before(firstB)) {
					firstB = r.first
				}
			}
			// The log's clock is to the second.
			t.Logf("black hole: A stepped down at %+.0fs (log time), B took the lock at %+.0fs (ended the old walsender: %v) and streamed after %v",
				stepDown.Sub(holed.Truncate(time.Second)).Seconds(), takeOver.Sub(holed.Truncate(time.Second)).Seconds(), ended, streaming.Round(time.Millisecond))
			t.Logf("deliveries: %s", describeRuns(runs, holed))
			t.Logf("A's last delivery %v after the black hole, B's first %v after; both delivered for %v (%d overlapping runs); %d events, none lost",
				lastA.Sub(holed).Round(time.Millisecond), firstB.Sub(holed).Round(time.Millisecond), overlap, pairs, len(keys))
			if pairs != 0 {
				t.Errorf("the two relays delivered at the same time: %s", describeRuns(runs, holed))
			}
			// Ping every 1 s with a 2 s timeout, then a 1 s drain.
			if d := lastA.Sub(holed); d > 4500*time.Millisecond {
				t.Errorf("relay A delivered until %v after its lock connection was black-holed, want at most 4.5 s", d)
			}
			// LeaderStaleAfter (10 s) from A's last ping, B's 1 s wait
			// between tries, then a term's start.
			if firstB.IsZero() || firstB.Sub(holed) > 20*time.Second {
				t.Errorf("relay B's first delivery came %v after the black hole, want within 20 s", firstB.Sub(holed))
			}
			s.checkDeliveries(t)
		})
	}
}

// TestBlackHole_LeaderLockConnection: only the leader's open lock
// connection is black-holed (a dead NAT entry: new connections work). The
// leader steps down when its ping fails, and after its stand-by pause ends
// its own lost lock session and leads again, or the standby does; either
// way one relay delivers at a time and nothing is lost.
func TestBlackHole_LeaderLockConnection(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	pgA, logA, logB := s.twoRelays(t)

	var wg sync.WaitGroup
	wg.Go(func() { s.publishWritersPaced(t, 2, 3000, 20, "lbc", 4*time.Millisecond) })
	eventually(t, 20*time.Second, "deliveries before the fault", func() bool { return len(s.hook.deliveries()) >= 200 })

	pgA.BlackHoleConns(isLeaderLockConn, netfault.NewConnsPass)
	holed := time.Now()
	eventually(t, 10*time.Second, "relay A stepping down", func() bool { return strings.Contains(logA.String(), "lost the leader lock") })
	eventually(t, 30*time.Second, "a leader again", func() bool {
		return strings.Count(logA.String(), "leader for the slot") >= 2 || strings.Contains(logB.String(), "leader for the slot")
	})
	wg.Wait()
	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 90*time.Second, keys)

	runs := deliveryRuns(s.hook.deliveries(), holed.Add(-time.Second))
	overlap, pairs := bothDelivered(runs)
	t.Logf("deliveries: %s", describeRuns(runs, holed))
	var pause time.Duration
	for i := 1; i < len(runs); i++ {
		pause = max(pause, runs[i].first.Sub(runs[i-1].last))
	}
	t.Logf("lock connection black-holed: delivery paused for %v; both delivered for %v (%d overlapping runs); %d events, none lost",
		pause.Round(time.Millisecond), overlap, pairs, len(keys))
	if strings.Contains(logA.String(), "own lost") || strings.Contains(logA.String(), "that it lost") {
		t.Log("relay A ended its own lost lock session")
	}
	if pairs != 0 {
		t.Errorf("the two relays delivered at the same time: %s", describeRuns(runs, holed))
	}
	s.checkDeliveries(t)
}
