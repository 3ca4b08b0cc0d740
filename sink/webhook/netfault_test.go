package webhook_test

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// A receiver black-holed after it read the request: the request was written
// and may have been processed, so the outcome is Unknown, whether the black
// hole is a proxy that stops forwarding or a link that goes down.
func TestBlackHoledReceiver_AfterTheRequestWasWritten_IsUnknown(t *testing.T) {
	tests := []struct {
		name string
		// start returns the receiver's URL as the sink reaches it and
		// the function that black-holes it.
		start func(t *testing.T, h http.Handler) (url string, blackHole func())
	}{
		{"proxy", func(t *testing.T, h http.Handler) (string, func()) {
			srv := httptest.NewServer(h)
			t.Cleanup(srv.Close)
			proxy, url := netfault.ProxyURL(t, srv.URL)
			return url, func() { proxy.BlackHole(netfault.NewConnsBlackHole) }
		}},
		{"link down", func(t *testing.T, h http.Handler) (string, func()) {
			ns := netfault.NewNamespace(t)
			link := netfault.NewLink(t, nil, ns)
			l, err := ns.Listen("tcp", net.JoinHostPort(link.AddrB(), "8080"))
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewUnstartedServer(h)
			srv.Listener = l
			srv.Start()
			t.Cleanup(srv.Close)
			return srv.URL, func() {
				if err := link.Down(); err != nil {
					t.Error(err)
				}
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			read := make(chan struct{}, 1)
			holed := make(chan struct{})
			var answered atomic.Int32
			url, blackHole := tt.start(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				read <- struct{}{}
				<-holed // the answer goes into the black hole
				answered.Add(1)
				w.WriteHeader(http.StatusOK)
			}))
			s := MustSink(t, webhook.Config{URL: url, Timeout: time.Second})

			errs := make(chan error, 1)
			s.Send(t.Context(), newDelivery("evt-written", `{"n":1}`), func(err error) { errs <- err })
			select {
			case <-read:
			case <-time.After(5 * time.Second):
				t.Fatal("the receiver never read the request")
			}
			blackHole()
			close(holed)

			err := <-errs
			if c, _ := relay.Classify(err); err == nil || c != relay.Unknown {
				t.Fatalf("outcome: %v; want unknown (the request was written)", err)
			}
			if !strings.Contains(err.Error(), "evt-written") {
				t.Errorf("error does not name the event: %v", err)
			}
			if answered.Load() != 1 {
				t.Errorf("receiver answered %d times", answered.Load())
			}
		})
	}
}

// A receiver whose connects never complete (the link is down before the
// request, so the SYN is dropped): nothing was sent. As the package's
// outcome table says for a dial timeout, that is SinkDown: every event
// would fail alike, and none may use up its attempts. Never Unknown.
func TestBlackHoledReceiver_ConnectNeverCompletes_IsNotSent(t *testing.T) {
	ns := netfault.NewNamespace(t)
	link := netfault.NewLink(t, nil, ns)
	l, err := ns.Listen("tcp", net.JoinHostPort(link.AddrB(), "8080"))
	if err != nil {
		t.Fatal(err)
	}
	var requests atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
	}))
	srv.Listener = l
	srv.Start()
	t.Cleanup(srv.Close)

	s := MustSink(t, webhook.Config{URL: srv.URL, Timeout: 700 * time.Millisecond})
	if err := link.Down(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = send(t, s, newDelivery("evt-unsent", `{"n":1}`))
	took := time.Since(start)
	if c, _ := relay.Classify(err); err == nil || c != relay.SinkDown || !strings.Contains(err.Error(), "cannot connect") {
		t.Fatalf("outcome: %v; want sink-down, cannot connect (nothing was sent)", err)
	}
	if took < 500*time.Millisecond {
		t.Errorf("failed after %s: a dropped SYN should wait for the timeout", took)
	}
	t.Logf("connect never completes: %v after %s", err, took.Round(time.Millisecond))

	// Back up: the same event is delivered, once. The first connection
	// attempts after the link comes up may still be lost while the link
	// settles; each ends "cannot connect" (nothing written), and the event
	// is sent again, at most for 10 s.
	if err := link.Up(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		err := send(t, s, newDelivery("evt-unsent", `{"n":1}`))
		if err == nil {
			break
		}
		if c, _ := relay.Classify(err); c != relay.SinkDown || !strings.Contains(err.Error(), "cannot connect") || time.Now().After(deadline) {
			t.Fatalf("after the link came back: %v", err)
		}
	}
	if requests.Load() != 1 {
		t.Errorf("receiver saw %d requests, want 1", requests.Load())
	}
}

// A kept-alive connection black-holed while idle, new connections fine (a
// NAT entry that expired): the next request is written to the dead
// connection and ends Unknown at the timeout; the transport drops that
// connection, and the re-send goes out on a new one and is delivered.
func TestBlackHoledIdleConnection_UnknownThenDeliveredOnANewConnection(t *testing.T) {
	rc := MustReceiver(t, nil)
	proxy, url := netfault.ProxyURL(t, rc.URL)
	s := MustSink(t, webhook.Config{URL: url, Timeout: 700 * time.Millisecond})

	if err := send(t, s, newDelivery("evt-1", `{"n":1}`)); err != nil {
		t.Fatal(err)
	}
	proxy.BlackHole(netfault.NewConnsPass)
	err := send(t, s, newDelivery("evt-2", `{"n":2}`))
	if c, _ := relay.Classify(err); err == nil || c != relay.Unknown {
		t.Fatalf("request on the black-holed kept-alive connection: %v; want unknown", err)
	}
	if err := send(t, s, newDelivery("evt-2", `{"n":2}`)); err != nil {
		t.Fatalf("re-send on a new connection: %v", err)
	}
	if got := proxy.Accepted(); got != 2 {
		t.Errorf("proxy accepted %d connections, want 2 (the dead one, then a new one)", got)
	}
	if n := len(rc.Requests()); n != 2 {
		t.Errorf("receiver read %d requests, want 2 (evt-1, and evt-2 once)", n)
	}
}
