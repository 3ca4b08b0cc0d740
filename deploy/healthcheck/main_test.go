package main

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestCheck(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/healthz":
			w.WriteHeader(http.StatusOK)
		case "/readyz":
			http.Error(w, "not leader", http.StatusServiceUnavailable)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)

	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedAddr := closed.Addr().String()
	closed.Close()

	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { silent.Close() })

	garbage, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { garbage.Close() })
	go func() {
		for {
			c, err := garbage.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("SSH-2.0-OpenSSH\r\n"))
			c.Close()
		}
	}()

	tests := []struct {
		name    string
		url     string
		wantErr string // empty: success
	}{
		{name: "2xx", url: srv.URL + "/healthz"},
		{name: "503", url: srv.URL + "/readyz", wantErr: "503"},
		{name: "404", url: srv.URL + "/nope", wantErr: "404"},
		{name: "connection refused", url: "http://" + closedAddr + "/healthz", wantErr: "refused"},
		{name: "no answer", url: "http://" + silent.Addr().String() + "/healthz", wantErr: "timeout"},
		{name: "not http", url: "http://" + garbage.Addr().String() + "/healthz", wantErr: "malformed status line"},
		{name: "https refused", url: "https://127.0.0.1:9187/healthz", wantErr: "want an http://"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := check(tt.url, 500*time.Millisecond)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("check(%s) = %v, want nil", tt.url, err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("check(%s) = %v, want an error containing %q", tt.url, err, tt.wantErr)
			}
		})
	}
}
