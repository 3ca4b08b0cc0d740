// Command healthcheck is the container image's HEALTHCHECK: it asks the
// relay's /healthz and exits 0 on a 2xx answer, 1 otherwise.
//
// The final image is distroless (no shell, no curl), and the relay binary
// has no health subcommand, so this tiny static program ships beside it. It
// speaks just enough HTTP/1.0 over a plain TCP connection to read the status
// line, which keeps it far smaller than a net/http client.
//
// Usage: healthcheck [URL] (default http://127.0.0.1:9187/healthz). Give the
// URL when http.listen moves the relay to another port.
package main

import (
	"bufio"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
)

const (
	defaultURL = "http://127.0.0.1:9187/healthz"
	timeout    = 3 * time.Second
)

func main() {
	target := defaultURL
	if len(os.Args) > 1 {
		target = os.Args[1]
	}
	if err := check(target, timeout); err != nil {
		fmt.Fprintln(os.Stderr, "healthcheck:", err)
		os.Exit(1)
	}
}

// check GETs target (an http:// URL) and returns nil when the answer's status
// is 2xx. It returns an error naming the status, or the failure to connect,
// write or read within timeout. It is safe to repeat.
func check(target string, timeout time.Duration) error {
	u, err := url.Parse(target)
	if err != nil {
		return err
	}
	if u.Scheme != "http" || u.Host == "" {
		return fmt.Errorf("%q: want an http://host:port/path URL", target)
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "80")
	}
	conn, err := net.DialTimeout("tcp", host, timeout)
	if err != nil {
		return err
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
		return err
	}
	if _, err := fmt.Fprintf(conn, "GET %s HTTP/1.0\r\nHost: %s\r\nUser-Agent: outbox-relay-healthcheck\r\n\r\n", u.RequestURI(), u.Host); err != nil {
		return err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return fmt.Errorf("read status line: %w", err)
	}
	// "HTTP/1.1 200 OK"
	fields := strings.Fields(line)
	if len(fields) < 2 || !strings.HasPrefix(fields[0], "HTTP/") {
		return fmt.Errorf("malformed status line %q", strings.TrimSpace(line))
	}
	code, err := strconv.Atoi(fields[1])
	if err != nil {
		return fmt.Errorf("malformed status line %q", strings.TrimSpace(line))
	}
	if code < 200 || code > 299 {
		return fmt.Errorf("%s: %s", target, strings.TrimSpace(strings.Join(fields[1:], " ")))
	}
	return nil
}
