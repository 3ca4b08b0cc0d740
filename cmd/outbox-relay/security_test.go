package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"github.com/nats-io/nkeys"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"io"
	stdlog "log"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

// startLogged runs the relay in this process at debug level, its log in buf.
func startLogged(t *testing.T, cfgPath string, buf io.Writer) (stop func()) {
	t.Helper()
	return runInProcess(t, config.Options{Path: cfgPath, Environ: []string{}},
		zerolog.New(buf).Level(zerolog.DebugLevel).With().Timestamp().Logger())
}

const (
	pgSecret   = "pg-SECRET-123"
	jwtSecret  = "jwt-SECRET-456"
	natsSecret = "nats-SECRET-789"
)

func assertNoSecrets(t *testing.T, what, out string) {
	t.Helper()
	for _, secret := range []string{pgSecret, jwtSecret, natsSecret} {
		if strings.Contains(out, secret) {
			i := strings.Index(out, secret)
			t.Errorf("%s leaks %q: …%s…", what, secret, out[max(0, i-200):min(len(out), i+len(secret)+50)])
		}
	}
}

// TestSecretsNeverLeak runs the relay with known secrets (a database
// password, a webhook JWT secret, a NATS token) through start, deliveries, a
// sink-level failure (401, then 204) and shutdown, at debug level, then runs
// status, doctor and config, and a failing migrate with an unreachable
// database: none of the secrets appears in any log line or output.
func TestSecretsNeverLeak(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	ctx := context.Background()
	if _, err := s.pool.Exec(ctx, `DO $$ BEGIN
		IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'relay_sec') THEN
			CREATE ROLE relay_sec LOGIN SUPERUSER REPLICATION PASSWORD 'pg-SECRET-123';
		END IF; END $$`); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(s.url)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword("relay_sec", pgSecret)
	dbURL := u.String()
	s.nats = natstest.Start(t, natstest.WithToken(natsSecret))

	var failed sync.Once
	s.hook.setReply(func(delivery) int {
		status := http.StatusNoContent
		failed.Do(func() { status = http.StatusUnauthorized })
		return status
	})

	path := filepath.Join(s.dir, "relay.yaml")
	cfg := fmt.Sprintf(`database_url: %q
data_dir: %q
delivery:
  backoff: [1s]
source: {poll_interval: 200ms}
sinks:
  - name: nats
    type: nats
    url: %s
    token: %q
  - name: hook
    type: webhook
    url: %s
    auth: {type: jwt, secret: %q}
log: {level: debug, format: json}
shutdown_timeout: 10s
http: {listen: "127.0.0.1:0"}
`, dbURL, filepath.Join(s.dir, "data"), s.nats.URL(), natsSecret, s.hook.URL, jwtSecret)
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}

	var logs syncBuffer
	stop := startLogged(t, path, &logs)
	s.waitSlot(t)
	s.publishWriters(t, 2, 10, 4, "sec")
	keys := s.keys(t, "true")
	eventually(t, 60*time.Second, "every event at both sinks", func() bool {
		hook := byKey(s.hook.deliveries())
		msgs := byKey(natsMessages(t, s.nats))
		for k := range keys {
			if len(hook[k]) == 0 || len(msgs[k]) == 0 {
				return false
			}
		}
		return true
	})
	stop()
	out := logs.String()
	if !strings.Contains(out, "401") {
		t.Errorf("the log does not show the 401 failure; the failure path was not exercised:\n%s", out)
	}
	assertNoSecrets(t, "the relay's log", out)

	for _, args := range [][]string{
		{"status", "--config", path},
		{"doctor", "--config", path},
		{"config", "--config", path},
		{"status", "--config", path, "--database-url", "postgres://relay_sec:" + pgSecret + "@127.0.0.1:1/x?connect_timeout=2"},
		{"migrate", "--config", path, "--database-url", "postgres://relay_sec:" + pgSecret + "@127.0.0.1:1/x?connect_timeout=2"},
		{"config", "--database-url", "host=127.0.0.1 user=relay_sec password=" + pgSecret},
	} {
		var stdout, stderr bytes.Buffer
		code := Execute(ctx, args, &stdout, &stderr)
		t.Logf("%v: exit %d", args, code)
		assertNoSecrets(t, fmt.Sprintf("%v stdout", args), stdout.String())
		assertNoSecrets(t, fmt.Sprintf("%v stderr", args), stderr.String())
	}
}

// natsMessages reads the OUTBOX stream of a server that may need a token
// (nil while the stream does not exist).
func natsMessages(t *testing.T, srv *natstest.Server) []delivery {
	t.Helper()
	var out []delivery
	forEachOutboxMessage(t, srv, func(m jetstream.Msg) {
		out = append(out, parseDelivery(m.Data(), natsIdemKey(m.Headers())))
	})
	return out
}

// forEachOutboxMessage calls visit for every message of the OUTBOX stream of
// srv, in order, and reports whether the stream exists.
func forEachOutboxMessage(t *testing.T, srv *natstest.Server, visit func(jetstream.Msg)) bool {
	t.Helper()
	nc, err := nats.Connect(srv.URL(), srv.ClientOptions()...)
	if err != nil {
		t.Fatalf("nats: %v", err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := js.Stream(ctx, "OUTBOX")
	if err != nil {
		return false
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	for {
		batch, err := cons.FetchNoWait(1000)
		if err != nil {
			t.Fatalf("fetch: %v", err)
		}
		n := 0
		for m := range batch.Messages() {
			visit(m)
			n++
		}
		if n == 0 {
			return true
		}
	}
}

// pki is a CA made for one test, and the files of the certificates it
// issued.
type pki struct {
	dir    string
	cert   *x509.Certificate
	key    *ecdsa.PrivateKey
	pool   *x509.CertPool
	caFile string
}

func newPKI(t *testing.T, name string) *pki {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	p := &pki{dir: t.TempDir(), cert: cert, key: key, pool: x509.NewCertPool()}
	p.pool.AddCert(cert)
	p.caFile = filepath.Join(p.dir, "ca.crt")
	writePEM(t, p.caFile, "CERTIFICATE", der)
	return p
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

var serial int64 = 100

// issue makes a leaf certificate for 127.0.0.1 and localhost, for a server
// or a client, and writes NAME.crt and NAME.key.
func (p *pki) issue(t *testing.T, name string, client bool) (tls.Certificate, string, string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial++
	usage := x509.ExtKeyUsageServerAuth
	if client {
		usage = x509.ExtKeyUsageClientAuth
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:     []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.cert, &key.PublicKey, p.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := filepath.Join(p.dir, name+".crt"), filepath.Join(p.dir, name+".key")
	writePEM(t, certFile, "CERTIFICATE", der)
	writePEM(t, keyFile, "EC PRIVATE KEY", keyDER)
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	return pair, certFile, keyFile
}

// loadSinkConfig loads a config file holding one sink (YAML under sinks:).
func loadSinkConfig(t *testing.T, sink string) (*config.Config, error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "relay.yaml")
	doc := fmt.Sprintf("data_dir: %q\nsinks:\n%s\n", t.TempDir(), sink)
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return config.Load(config.Options{Path: path, Environ: []string{}})
}

// sendOne opens the configured sinks as run does and sends one event to the
// first; it returns the open error or the send's outcome.
func sendOne(t *testing.T, cfg *config.Config) (openErr, sendErr error) {
	t.Helper()
	return sendUntil(t, cfg, func(error) bool { return true })
}

// sendUntil is sendOne sending again, on the same sink, until done accepts
// the send's error or 10 s have passed: a sink that is down reports the
// last reason it knows, and the reason a refused connection gives may come
// a moment after the first attempt (a TLS 1.3 server's alert).
func sendUntil(t *testing.T, cfg *config.Config, done func(error) bool) (openErr, sendErr error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	scope := msgIDScope{outbox: relay.QualifiedName{Schema: "public", Name: "integration_outbox"}, scopedFrom: 1,
		identity: admin.Identity{SystemIdentifier: "1", Database: "test"}}
	routes, err := openSinks(ctx, cfg, scope, zerolog.New(zerolog.NewTestWriter(t)))
	defer func() {
		for _, r := range routes {
			r.Sink.Close(ctx)
		}
	}()
	if err != nil {
		return err, nil
	}
	typ, agg, id := "order.placed", "order", "1"
	ev := &relay.Event{ID: 1, EventKey: "tls-1", EventType: &typ, AggregateType: &agg, AggregateID: &id, Payload: []byte(`{}`), CreatedAt: time.Now()}
	deadline := time.Now().Add(10 * time.Second)
	for {
		result := make(chan error, 1)
		routes[0].Sink.Send(ctx, &relay.Delivery{Event: ev, Body: []byte(`{"event_key":"tls-1"}`), Attempt: 1}, func(err error) { result <- err })
		select {
		case sendErr = <-result:
		case <-ctx.Done():
			t.Fatal("send did not finish")
			return nil, nil
		}
		if done(sendErr) || time.Now().After(deadline) {
			return nil, sendErr
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestWebhookTLS: a webhook sink trusts the CA in tls.ca_file and presents
// the client certificate in tls.cert_file/key_file. A server certificate
// that does not verify fails the send as SinkDown: the sink's circuit opens
// and the event is not charged an attempt, as for a 401. A client
// certificate the server refuses is SinkDown too when the relay reads the
// server's alert; with TLS 1.3 the request write may race the alert and end
// in "use of closed connection" first, which is Transient (retried with
// backoff). It is never Unknown: the receiver never got the request.
func TestWebhookTLS(t *testing.T) {
	ca, other := newPKI(t, "test CA"), newPKI(t, "other CA")
	serverCert, _, _ := ca.issue(t, "server", false)
	_, clientCert, clientKey := ca.issue(t, "client", true)
	_, otherCert, otherKey := other.issue(t, "intruder", true)

	var got sync.Map
	start := func(mtls bool) *httptest.Server {
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			got.Store(r.Header.Get("webhook-id"), true)
			w.WriteHeader(http.StatusNoContent)
		}))
		srv.TLS = &tls.Config{Certificates: []tls.Certificate{serverCert}, MinVersion: tls.VersionTLS12}
		if mtls {
			srv.TLS.ClientAuth = tls.RequireAndVerifyClientCert
			srv.TLS.ClientCAs = ca.pool
		}
		srv.Config.ErrorLog = stdlog.New(io.Discard, "", 0)
		srv.StartTLS()
		t.Cleanup(srv.Close)
		return srv
	}
	plain, mutual := start(false), start(true)
	sink := func(url, tlsYAML string) string {
		return fmt.Sprintf("  - {name: hook, type: webhook, url: %q, tls: %s}", url, tlsYAML)
	}

	for _, tc := range []struct {
		name, url, tls string
		ok             bool
		mayBeTransient bool
	}{
		{"trusted CA", plain.URL, fmt.Sprintf("{ca_file: %q}", ca.caFile), true, false},
		{"unknown CA", plain.URL, fmt.Sprintf("{ca_file: %q}", other.caFile), false, false},
		{"system roots", plain.URL, "{}", false, false},
		{"insecure_skip_verify", plain.URL, "{insecure_skip_verify: true}", true, false},
		{"mTLS without a client certificate", mutual.URL, fmt.Sprintf("{ca_file: %q}", ca.caFile), false, true},
		{"mTLS with a certificate of another CA", mutual.URL, fmt.Sprintf("{ca_file: %q, cert_file: %q, key_file: %q}", ca.caFile, otherCert, otherKey), false, true},
		{"mTLS with a client certificate", mutual.URL, fmt.Sprintf("{ca_file: %q, cert_file: %q, key_file: %q}", ca.caFile, clientCert, clientKey), true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := loadSinkConfig(t, sink(tc.url, tc.tls))
			if err != nil {
				t.Fatal(err)
			}
			openErr, sendErr := sendOne(t, cfg)
			if openErr != nil {
				t.Fatalf("open: %v", openErr)
			}
			if tc.ok {
				if sendErr != nil {
					t.Fatalf("send: %v", sendErr)
				}
				return
			}
			if sendErr == nil {
				t.Fatal("send succeeded; want a TLS failure")
			}
			class, _ := relay.Classify(sendErr)
			if class != relay.SinkDown && !(tc.mayBeTransient && class == relay.Transient) {
				t.Errorf("class %v, want sink-down: %v", class, sendErr)
			}
			t.Logf("%v: %v", class, sendErr)
		})
	}
}

// startTLSNATS starts an embedded nats-server with JetStream that requires
// TLS with cert, and client certificates of clientCAs when it is not nil.
func startTLSNATS(t *testing.T, cert tls.Certificate, clientCAs *x509.CertPool) string {
	t.Helper()
	tc := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	opts := &server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true, StoreDir: t.TempDir(),
		NoLog: true, NoSigs: true, TLS: true, TLSConfig: tc, TLSTimeout: 5}
	if clientCAs != nil {
		tc.ClientAuth = tls.RequireAndVerifyClientCert
		tc.ClientCAs = clientCAs
		opts.TLSVerify = true
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server not ready")
	}
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	return fmt.Sprintf("nats://127.0.0.1:%d", srv.Addr().(*net.TCPAddr).Port)
}

// TestNATSTLS: a NATS sink connects over TLS to a server whose certificate
// its tls.ca_file trusts, with a client certificate when the server wants
// one, and publishes; with a wrong CA or a missing client certificate the
// sink is down (as a webhook whose certificate is refused), its Sends
// naming the TLS failure, and run does not stop (docs/sinks.md, "A server
// down at start").
func TestNATSTLS(t *testing.T) {
	ca, other := newPKI(t, "test CA"), newPKI(t, "other CA")
	serverCert, _, _ := ca.issue(t, "server", false)
	_, clientCert, clientKey := ca.issue(t, "client", true)
	tlsOnly := startTLSNATS(t, serverCert, nil)
	mutual := startTLSNATS(t, serverCert, ca.pool)

	for _, tc := range []struct {
		name, url, tls string
		ok             bool
	}{
		{"trusted CA", tlsOnly, fmt.Sprintf("{ca_file: %q}", ca.caFile), true},
		{"wrong CA", tlsOnly, fmt.Sprintf("{ca_file: %q}", other.caFile), false},
		{"no tls section", tlsOnly, "", false},
		{"mTLS without a client certificate", mutual, fmt.Sprintf("{ca_file: %q}", ca.caFile), false},
		{"mTLS with a client certificate", mutual, fmt.Sprintf("{ca_file: %q, cert_file: %q, key_file: %q}", ca.caFile, clientCert, clientKey), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sink := fmt.Sprintf("  - name: n\n    type: nats\n    url: %s\n", tc.url)
			if tc.tls != "" {
				sink += "    tls: " + tc.tls + "\n"
			}
			cfg, err := loadSinkConfig(t, sink)
			if err != nil {
				t.Fatal(err)
			}
			refused := func(err error) bool {
				class, _ := relay.Classify(err)
				return class == relay.SinkDown && namesTLS(err)
			}
			accept := func(error) bool { return true }
			if !tc.ok {
				accept = refused
			}
			openErr, sendErr := sendUntil(t, cfg, accept)
			if !tc.ok {
				if class, _ := relay.Classify(sendErr); openErr != nil || class != relay.SinkDown || !namesTLS(sendErr) {
					t.Fatalf("open: %v, send: %v; want the sink down, naming the TLS failure", openErr, sendErr)
				}
				t.Logf("send: %v", sendErr)
				return
			}
			if openErr != nil || sendErr != nil {
				t.Fatalf("open: %v, send: %v", openErr, sendErr)
			}
		})
	}
}

// TestTLSConfigValidation: the tls keys are checked at load, with errors
// naming the key.
func TestTLSConfigValidation(t *testing.T) {
	ca := newPKI(t, "test CA")
	_, cert, key := ca.issue(t, "client", true)
	missing := filepath.Join(t.TempDir(), "missing.crt")
	for _, tc := range []struct{ sink, want string }{
		{`  - {name: h, type: webhook, url: "http://127.0.0.1:1/", tls: {ca_file: "` + ca.caFile + `"}}`, "sinks[0].tls: is only used with an https:// url"},
		{`  - {name: n, type: nats, tls: {ca_file: "` + ca.caFile + `"}}`, "sinks[0].tls: is not used by the embedded NATS server"},
		{`  - {name: h, type: webhook, url: "https://127.0.0.1:1/", tls: {ca_file: "` + missing + `"}}`, "sinks[0].tls.ca_file: open " + missing},
		{`  - {name: h, type: webhook, url: "https://127.0.0.1:1/", tls: {ca_file: "` + key + `"}}`, "sinks[0].tls.ca_file: " + key + " holds no PEM certificate"},
		{`  - {name: h, type: webhook, url: "https://127.0.0.1:1/", tls: {cert_file: "` + cert + `"}}`, "sinks[0].tls.key_file: is required with cert_file"},
		{`  - {name: n, type: nats, url: "nats://127.0.0.1:1", tls: {key_file: "` + key + `"}}`, "sinks[0].tls.cert_file: is required with key_file"},
		{`  - {name: n, type: nats, url: "nats://127.0.0.1:1", tls: {cert_file: "` + key + `", key_file: "` + key + `"}}`, "sinks[0].tls.cert_file: load the key pair"},
		{`  - {name: n, type: nats, url: "nats://127.0.0.1:1", tls: {cafile: x}}`, "cafile"},
	} {
		_, err := loadSinkConfig(t, tc.sink)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s:\n got %v\nwant %q", tc.sink, err, tc.want)
		}
	}
	if _, err := loadSinkConfig(t, `  - {name: n, type: nats, url: "nats://127.0.0.1:1", tls: {ca_file: "`+ca.caFile+`", cert_file: "`+cert+`", key_file: "`+key+`"}}`); err != nil {
		t.Errorf("valid tls section refused: %v", err)
	}
}

// TestPostgresTLS: database_url with sslmode=verify-full and sslrootcert
// connects to a server whose certificate (SAN IP 127.0.0.1) the CA signed,
// and is refused with another CA.
func TestPostgresTLS(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster: skipped with -short")
	}
	ca, other := newPKI(t, "test CA"), newPKI(t, "other CA")
	_, certFile, keyFile := ca.issue(t, "server", false)
	// The server runs as the postgres user when the test runs as root: the
	// files go where it can read them, the key 0600 and owned by it.
	dir, err := os.MkdirTemp("", "pgtls-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	var files []string
	for _, f := range []string{certFile, keyFile} {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(dir, filepath.Base(f))
		if err := os.WriteFile(dst, data, 0o600); err != nil {
			t.Fatal(err)
		}
		files = append(files, dst)
	}
	if err := chownToServer(dir, files); err != nil {
		skipOrFailInCI(t, "cannot hand the key to the server's user: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := pgtest.StartCluster(ctx, pgtest.Options{Settings: map[string]string{
		"ssl": "on", "ssl_cert_file": files[0], "ssl_key_file": files[1],
	}})
	if err != nil {
		skipOrFailInCI(t, "no PostgreSQL cluster: %v", err)
	}
	t.Cleanup(func() { c.Close() })

	base := strings.Replace(c.URL("postgres"), "sslmode=disable", "sslmode=verify-full&sslrootcert=", 1)
	conn, err := pgx.Connect(ctx, base+url.QueryEscape(ca.caFile))
	if err != nil {
		t.Fatalf("verify-full with the right CA: %v", err)
	}
	var ssl bool
	if err := conn.QueryRow(ctx, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl); err != nil || !ssl {
		t.Errorf("connection not encrypted (ssl=%v, err=%v)", ssl, err)
	}
	conn.Close(ctx)

	if conn, err := pgx.Connect(ctx, base+url.QueryEscape(other.caFile)); err == nil {
		conn.Close(ctx)
		t.Fatal("verify-full with another CA connected")
	} else if !strings.Contains(err.Error(), "certificate") {
		t.Errorf("want a certificate error, got %v", err)
	}
}

// TestMetricsToken: with http.metrics_token set, /metrics needs the bearer
// token; /healthz and /readyz do not.
func TestMetricsToken(t *testing.T) {
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte("metrics-SECRET\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "relay.yaml")
	if err := os.WriteFile(path, []byte(fmt.Sprintf("http: {listen: \"127.0.0.1:0\", metrics_token_file: %q, pprof: true}\n", tokenFile)), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(config.Options{Path: path, Environ: []string{}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := &health{}
	h.set(true, "")
	addr, _, err := serveHTTP(ctx, cfg.HTTP, h, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	get := func(path, auth string) int {
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr.String()+path, nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, tc := range []struct {
		path, auth string
		want       int
	}{
		{"/metrics", "", 401},
		{"/metrics", "Bearer wrong", 401},
		{"/metrics", "Basic bWV0cmljcy1TRUNSRVQ=", 401},
		{"/metrics", "Bearer metrics-SECRET", 200},
		{"/metrics", "bearer metrics-SECRET", 200},
		{"/debug/pprof/", "", 401},
		{"/debug/pprof/cmdline", "Bearer wrong", 401},
		{"/debug/pprof/cmdline", "Bearer metrics-SECRET", 200},
		{"/debug/pprof/heap", "Bearer metrics-SECRET", 200},
		{"/healthz", "", 200},
		{"/readyz", "", 200},
	} {
		if got := get(tc.path, tc.auth); got != tc.want {
			t.Errorf("GET %s with %q: %d, want %d", tc.path, tc.auth, got, tc.want)
		}
	}

	// Without a token /metrics is open; a token with a space is refused.
	open := &config.Config{}
	*open = config.Default()
	open.HTTP.Listen = "127.0.0.1:0"
	addr, _, err = serveHTTP(ctx, open.HTTP, h, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	if got := get("/metrics", ""); got != 200 {
		t.Errorf("GET /metrics without a configured token: %d", got)
	}
	if got := get("/debug/pprof/cmdline", ""); got != 404 {
		t.Errorf("GET /debug/pprof/cmdline without http.pprof: %d, want 404", got)
	}
	if err := os.WriteFile(path, []byte("http: {metrics_token: \"a b\"}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := config.Load(config.Options{Path: path, Environ: []string{}}); err == nil || !strings.Contains(err.Error(), "http.metrics_token: must be printable") {
		t.Errorf("token with a space: %v", err)
	}
}

// chownToServer gives dir and files to the postgres OS user when the test
// runs as root (pgtest then runs the server as that user).
func chownToServer(dir string, files []string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return err
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	for _, p := range append([]string{dir}, files...) {
		if err := os.Chown(p, uid, gid); err != nil {
			return err
		}
	}
	return nil
}

// TestDoctorUsesSinkTLS: doctor checks a webhook with the sink's own tls
// section, so a private CA passes there exactly as it does for run.
func TestDoctorUsesSinkTLS(t *testing.T) {
	ca, other := newPKI(t, "test CA"), newPKI(t, "other CA")
	serverCert, _, _ := ca.issue(t, "server", false)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{serverCert}, MinVersion: tls.VersionTLS12}
	srv.Config.ErrorLog = stdlog.New(io.Discard, "", 0)
	srv.StartTLS()
	t.Cleanup(srv.Close)

	for _, tc := range []struct {
		name, caFile string
		ok           bool
	}{{"the sink's CA", ca.caFile, true}, {"another CA", other.caFile, false}} {
		cfg, err := loadSinkConfig(t, fmt.Sprintf("  - {name: hook, type: webhook, url: %q, tls: {ca_file: %q}}", srv.URL, tc.caFile))
		if err != nil {
			t.Fatal(err)
		}
		check := checkWebhook(context.Background(), 0, cfg.Sinks[0])
		if (check.Status == admin.OK) != tc.ok {
			t.Fatalf("%s: doctor says %s: %s", tc.name, check.Status, check.Detail)
		}
	}
}

// skipOrFailInCI skips a test whose prerequisite is missing, except under
// CI=true, where a missing prerequisite is a failure.
func skipOrFailInCI(t *testing.T, format string, args ...any) {
	t.Helper()
	if ci := os.Getenv("CI"); ci == "true" || ci == "1" {
		t.Fatalf("prerequisite missing under CI: "+format, args...)
	}
	t.Skipf(format+" (not skipped under CI: it fails there)", args...)
}

// TestNATSNkey: a NATS sink authenticates with a user NKey seed file
// (nkey_file); without it the server refuses the connection, and run keeps
// the sink down (every send fails as SinkDown naming the refusal).
func TestNATSNkey(t *testing.T) {
	user, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := user.PublicKey()
	seed, _ := user.Seed()
	seedFile := filepath.Join(t.TempDir(), "user.nk")
	if err := os.WriteFile(seedFile, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true,
		StoreDir: t.TempDir(), NoLog: true, NoSigs: true, Nkeys: []*server.NkeyUser{{Nkey: pub}}})
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server not ready")
	}
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	url := fmt.Sprintf("nats://127.0.0.1:%d", srv.Addr().(*net.TCPAddr).Port)

	for _, tc := range []struct {
		name, extra string
		ok          bool
	}{{"with nkey_file", fmt.Sprintf("    nkey_file: %q\n", seedFile), true}, {"without", "", false}} {
		cfg, err := loadSinkConfig(t, fmt.Sprintf("  - name: n\n    type: nats\n    url: %s\n%s", url, tc.extra))
		if err != nil {
			t.Fatal(err)
		}
		openErr, sendErr := sendOne(t, cfg)
		if tc.ok && (openErr != nil || sendErr != nil) {
			t.Fatalf("%s: open %v, send %v", tc.name, openErr, sendErr)
		}
		if class, _ := relay.Classify(sendErr); !tc.ok && (openErr != nil || class != relay.SinkDown || !errors.Is(sendErr, nats.ErrAuthorization)) {
			t.Fatalf("%s: open %v, send %v; want the sink down with the authorization violation", tc.name, openErr, sendErr)
		}
	}
}

// namesTLS reports whether err names a TLS failure: nats.go's own "tls
// error" (a certificate the relay refused), or the server's TLS alert
// ("remote error: tls: certificate required", when the server refuses the
// relay's missing certificate after a TLS 1.3 handshake).
func namesTLS(err error) bool {
	return err != nil && (strings.Contains(err.Error(), "tls error") || strings.Contains(err.Error(), "tls: "))
}
