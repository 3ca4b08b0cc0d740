package webhook_test

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// dropSecond is a raw HTTP/1.1 server: it answers every request with 200
// and keeps the connection open, except the second request it reads, which
// it reads completely and then closes the connection without answering —
// the case where net/http re-sends a replayable POST on its own.
type dropSecond struct {
	ln       net.Listener
	mu       sync.Mutex
	requests []string // "conn<i>/req<j> <Idempotency-Key>"
	conns    int
	wg       sync.WaitGroup
}

func mustDropSecond(t *testing.T) *dropSecond {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &dropSecond{ln: ln}
	srv.wg.Add(1)
	go srv.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		srv.wg.Wait()
	})
	return srv
}

func (srv *dropSecond) accept() {
	defer srv.wg.Done()
	for {
		conn, err := srv.ln.Accept()
		if err != nil {
			return
		}
		srv.mu.Lock()
		srv.conns++
		connNo := srv.conns
		srv.mu.Unlock()
		srv.wg.Add(1)
		go srv.serve(conn, connNo)
	}
}

func (srv *dropSecond) serve(conn net.Conn, connNo int) {
	defer srv.wg.Done()
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(conn)
	for reqNo := 1; ; reqNo++ {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if _, err := io.Copy(io.Discard, req.Body); err != nil {
			return
		}
		srv.mu.Lock()
		srv.requests = append(srv.requests, "conn"+strconv.Itoa(connNo)+"/req"+strconv.Itoa(reqNo)+" "+req.Header.Get("Idempotency-Key"))
		n := len(srv.requests)
		srv.mu.Unlock()
		if n == 2 {
			return // read in full, never answered
		}
		if _, err := io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"); err != nil {
			return
		}
	}
}

func (srv *dropSecond) Requests() []string {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	return append([]string(nil), srv.requests...)
}

func TestNoSilentResendOnReusedConnection(t *testing.T) {
	t.Parallel()
	srv := mustDropSecond(t)
	s := MustSink(t, webhook.Config{URL: "http://" + srv.ln.Addr().String() + "/hook", Concurrency: 1})

	if err := send(t, s, newDelivery("first", `{"n":1}`)); err != nil {
		t.Fatalf("first: %v", err)
	}
	err := send(t, s, newDelivery("second", `{"n":2}`))
	if class, _ := relay.Classify(err); class != relay.Unknown {
		t.Fatalf("second: class %s, want unknown (%v)", class, err)
	}
	time.Sleep(300 * time.Millisecond) // room for a re-send to arrive
	got := srv.Requests()
	want := []string{"conn1/req1 first", "conn1/req2 second"}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("server read %q, want exactly %q (one copy of the second request, on the reused connection)", got, want)
	}
}

// TestPlainClientResends shows the hazard the sink avoids, so the test
// above cannot pass only because its server fails to provoke a re-send:
// the same exchange through a plain http.Client and a bytes.Reader body
// (GetBody set) with an Idempotency-Key reaches the server twice.
func TestPlainClientResends(t *testing.T) {
	t.Parallel()
	srv := mustDropSecond(t)
	target := "http://" + srv.ln.Addr().String() + "/hook"
	client := &http.Client{Transport: &http.Transport{}, Timeout: 5 * time.Second}
	t.Cleanup(client.CloseIdleConnections)
	for _, key := range []string{"first", "second"} {
		req, err := http.NewRequest(http.MethodPost, target, bytes.NewReader([]byte(`{}`)))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", key, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
	}
	got := srv.Requests()
	if len(got) != 3 || got[2] != "conn2/req1 second" {
		t.Fatalf("server read %q, want the second request re-sent on a new connection", got)
	}
}
