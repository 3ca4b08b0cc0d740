package webhook

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"net/http/httptrace"
	"strings"
	"sync"
)

// writeTrace records the connection and WroteRequest events of one
// request.
type writeTrace struct {
	mu       sync.Mutex
	wrote    bool
	writeErr error
	// dialing is set while a dial for the request has started and not
	// connected; gotConn once the request has a connection.
	dialing, gotConn bool
}

func (w *writeTrace) connectStart(string, string) {
	w.mu.Lock()
	w.dialing = true
	w.mu.Unlock()
}

func (w *writeTrace) connectDone(_, _ string, err error) {
	if err == nil {
		w.mu.Lock()
		w.dialing = false
		w.mu.Unlock()
	}
}

func (w *writeTrace) gotConnection(httptrace.GotConnInfo) {
	w.mu.Lock()
	w.gotConn = true
	w.mu.Unlock()
}

// dialTimedOut reports whether err is the request's deadline passing while
// its only dial had not connected: the receiver never answered the SYN.
func (w *writeTrace) dialTimedOut(err error) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.dialing || w.gotConn {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	ne, ok := errors.AsType[net.Error](err)
	return ok && ne.Timeout()
}

func (w *writeTrace) wroteRequest(info httptrace.WroteRequestInfo) {
	w.mu.Lock()
	w.wrote, w.writeErr = true, info.Err
	w.mu.Unlock()
}

func (w *writeTrace) result() (bool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.wrote, w.writeErr
}

// tlsRefused reports whether err is a certificate problem of either side: the
// receiver's certificate did not verify, or the receiver refused the
// handshake (typically the client certificate: missing, unknown CA,
// expired).
func tlsRefused(err error) bool {
	if _, ok := errors.AsType[*tls.CertificateVerificationError](err); ok {
		return true
	}
	if _, ok := errors.AsType[x509.UnknownAuthorityError](err); ok {
		return true
	}
	if _, ok := errors.AsType[x509.HostnameError](err); ok {
		return true
	}
	// A received alert is a *net.OpError "remote error" around the tls
	// package's unexported alert type: only its text tells which alert.
	if op, ok := errors.AsType[*net.OpError](err); ok && op.Op == "remote error" && op.Err != nil {
		msg := op.Err.Error()
		for _, alert := range []string{
			"handshake failure", "bad certificate", "unsupported certificate",
			"revoked certificate", "expired certificate", "unknown certificate",
			"access denied", "protocol version not supported", "certificate required",
		} {
			if strings.HasSuffix(msg, "tls: "+alert) || strings.HasSuffix(msg, "tls: "+alert+" authority") {
				return true
			}
		}
	}
	return false
}

// unreachable reports whether err is a failure to connect to the receiver:
// its host does not resolve, or the connection is refused or times out.
// Cancellation by Close is not.
func unreachable(err error) bool {
	op, ok := errors.AsType[*net.OpError](err)
	return ok && op.Op == "dial" && !errors.Is(err, context.Canceled)
}
