package harness

import (
	"context"
	"net"
	"net/http"
	"time"
)

// HTTPServer serves a handler on a free loopback port: the webhook
// destination of the tools.
type HTTPServer struct {
	// URL is http://127.0.0.1:<port> followed by the path given to
	// ServeHTTP.
	URL string
	srv *http.Server
}

// ServeHTTP serves h on 127.0.0.1 on a free port until Close.
func ServeHTTP(h http.Handler, path string) (*HTTPServer, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &HTTPServer{URL: "http://" + ln.Addr().String() + path,
		srv: &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}}
	go func() { _ = s.srv.Serve(ln) }()
	return s, nil
}

// Close stops the server: it waits up to 5 s for requests in progress, then
// closes their connections.
func (s *HTTPServer) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.srv.Shutdown(ctx); err != nil {
		_ = s.srv.Close()
	}
}
