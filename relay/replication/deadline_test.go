package replication

import (
	"errors"
	"net"
	"os"
	"testing"
	"time"
)

// TestReadDeadlineEdges: the receiver's reads end at the deadline set for
// the status time, at once when the session ends (interrupt), and never
// again once the session has left the connection (clear): the edges of
// the one piece of state the receiver keeps on the connection instead of a
// context per read.
func TestReadDeadlineEdges(t *testing.T) {
	pipe := func(t *testing.T) (net.Conn, net.Conn) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		accepted := make(chan net.Conn, 1)
		go func() {
			c, _ := ln.Accept()
			accepted <- c
		}()
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		peer := <-accepted
		t.Cleanup(func() { c.Close(); peer.Close() })
		return c, peer
	}
	// read reports how long a read took to fail, or fails the test if it
	// reads or takes longer than limit.
	read := func(t *testing.T, c net.Conn, limit time.Duration) time.Duration {
		t.Helper()
		done := make(chan error, 1)
		began := time.Now()
		go func() {
			_, err := c.Read(make([]byte, 1))
			done <- err
		}()
		select {
		case err := <-done:
			if !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("read: %v, want a deadline exceeded", err)
			}
			return time.Since(began)
		case <-time.After(limit):
			t.Fatalf("read still pending after %v", limit)
			return 0
		}
	}

	t.Run("status time", func(t *testing.T) {
		c, _ := pipe(t)
		d := &readDeadline{conn: c}
		d.set(time.Now().Add(100 * time.Millisecond))
		if took := read(t, c, 5*time.Second); took < 50*time.Millisecond {
			t.Fatalf("read ended after %v, before its deadline", took)
		}
	})
	t.Run("interrupt ends a pending read and later ones", func(t *testing.T) {
		c, _ := pipe(t)
		d := &readDeadline{conn: c}
		d.set(time.Now().Add(time.Hour))
		time.AfterFunc(50*time.Millisecond, d.interrupt)
		read(t, c, 5*time.Second)
		d.set(time.Now().Add(time.Hour)) // the receiver's next round
		if took := read(t, c, time.Second); took > 500*time.Millisecond {
			t.Fatalf("a read after interrupt took %v", took)
		}
	})
	t.Run("clear leaves the connection readable", func(t *testing.T) {
		c, peer := pipe(t)
		d := &readDeadline{conn: c}
		d.set(time.Now().Add(time.Hour))
		d.clear()
		d.interrupt() // the session's context ended after the receiver left
		d.set(time.Now())
		if _, err := peer.Write([]byte{1}); err != nil {
			t.Fatal(err)
		}
		// The byte is there: the read returns at once, unless a deadline
		// in the past was set after clear.
		if _, err := c.Read(make([]byte, 1)); err != nil {
			t.Fatalf("read after clear: %v", err)
		}
	})
}
