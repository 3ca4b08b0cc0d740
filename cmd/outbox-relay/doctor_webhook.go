package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"html"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// n8nStartingUp is what n8n answers every request while it starts.
const n8nStartingUp = "n8n is starting up. Please wait"

// checkWebhook sends the webhook sink a harmless probe and reads the
// answer (docs/n8n.md, "doctor's probe"): an OPTIONS request with the CORS
// preflight headers, which n8n answers from its webhook registrations
// without running a workflow, and which carries the sink's static
// credentials and headers for a proxy that checks them. A POST would
// deliver something. n8n's test URL is refused before anything is sent.
func checkWebhook(ctx context.Context, i int, s config.SinkConfig) admin.Check {
	name := "sink " + s.Name
	u, err := url.Parse(s.URL)
	if err != nil { // config.Validate refused it already
		return admin.Check{Name: name, Status: admin.Fail, Detail: "the url does not parse", Fix: fmt.Sprintf("fix sinks[%d].url", i)}
	}
	where := shownURL(u)
	if rest, ok := strings.CutPrefix(u.Path, "/webhook-test/"); ok {
		prod := *u
		prod.Path, prod.RawPath = "/webhook/"+rest, ""
		return admin.Check{Name: name, Status: admin.Fail,
			Detail: "the url is n8n's test URL (/webhook-test/): it takes one request after \"Execute workflow\" in the editor, then answers 404",
			Fix:    fmt.Sprintf("set sinks[%d].url to its production URL %s and publish (activate) the workflow", i, shownURL(&prod))}
	}

	tlsCfg, err := s.TLS.ClientConfig()
	if err != nil {
		return admin.Check{Name: name, Status: admin.Fail, Detail: err.Error(), Fix: "fix sinks[" + strconv.Itoa(i) + "].tls"}
	}
	client := &http.Client{
		Transport: &http.Transport{Proxy: http.ProxyFromEnvironment, TLSClientConfig: tlsCfg, DisableKeepAlives: true},
		// run does not follow redirects either.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		Timeout:       sinkCheckTimeout,
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodOptions, s.URL, nil)
	if err != nil {
		return admin.Check{Name: name, Status: admin.Fail, Detail: "the url does not make a request", Fix: fmt.Sprintf("fix sinks[%d].url", i)}
	}
	for k, v := range s.Webhook.Headers {
		req.Header.Set(k, v)
	}
	req.Header.Set("User-Agent", "outbox-relay doctor")
	req.Header.Set("Origin", u.Scheme+"://"+u.Host)
	req.Header.Set("Access-Control-Request-Method", http.MethodPost)
	// Signatures (jwt, standard-webhooks) cover a body; only the static
	// credentials go along.
	switch a := s.Webhook.Auth; a.Type {
	case config.AuthHeader:
		req.Header.Set(a.Header, a.Value.Reveal())
	case config.AuthBasic:
		req.SetBasicAuth(a.Username, a.Password.Reveal())
	}

	resp, err := client.Do(req)
	if err != nil {
		check := webhookUnreachable(i, u, err)
		check.Name = name
		return check
	}
	defer resp.Body.Close()
	head, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	check := webhookAnswer(i, s.Webhook.Auth.Type, where, u.Path, resp, head)
	check.Name = name
	if resp.TLS != nil && len(resp.TLS.PeerCertificates) > 0 && check.Status == admin.OK {
		check.Detail += fmt.Sprintf("; TLS certificate valid until %s", resp.TLS.PeerCertificates[0].NotAfter.UTC().Format(time.DateOnly))
	}
	return check
}

// shownURL is u without credentials, and with its query elided: a query
// may carry a token.
func shownURL(u *url.URL) string {
	s := u.Scheme + "://" + u.Host + u.EscapedPath()
	if u.RawQuery != "" {
		s += "?…"
	}
	return s
}

// bodyText is an answer's body as one line of text: HTML tags dropped,
// entities decoded, white space collapsed, at most n runes.
func bodyText(body []byte, n int) string {
	var b strings.Builder
	inTag := false
	for _, r := range string(body) {
		switch {
		case r == '<':
			inTag = true
			b.WriteRune(' ')
		case r == '>' && inTag:
			inTag = false
		case !inTag:
			b.WriteRune(r)
		}
	}
	text := strings.Join(strings.Fields(html.UnescapeString(b.String())), " ")
	if text == "" {
		return "(empty body)"
	}
	return excerpt(text, n)
}

// webhookUnreachable reports a probe that got no answer: no connection, or
// a TLS handshake the sink's tls settings do not accept.
func webhookUnreachable(i int, u *url.URL, err error) admin.Check {
	if ue, ok := errors.AsType[*url.Error](err); ok {
		err = ue.Err // url.Error repeats the URL, whose query may hold a token
	}
	addr := u.Host
	if u.Port() == "" {
		addr = net.JoinHostPort(u.Hostname(), map[string]string{"http": "80", "https": "443"}[u.Scheme])
	}
	if tlsFailure(err) {
		return admin.Check{Status: admin.Fail, Detail: fmt.Sprintf("TLS handshake with %s failed: %v", addr, err),
			Fix: "the server's certificate must be valid for " + u.Hostname() + " and signed by a CA this machine trusts (or the one in sinks[" + strconv.Itoa(i) + "].tls.ca_file)"}
	}
	return admin.Check{Status: admin.Fail, Detail: fmt.Sprintf("webhook host %s unreachable: %v", addr, unwrapOpError(err)),
		Fix: fmt.Sprintf("check sinks[%d].url (%s) and that the receiver is up and reachable from here (DNS, firewall, proxy)", i, addr)}
}

// tlsFailure reports a handshake that failed on the certificate or the
// protocol, as opposed to a connection that failed.
func tlsFailure(err error) bool {
	if _, ok := errors.AsType[*tls.CertificateVerificationError](err); ok {
		return true
	}
	if _, ok := errors.AsType[x509.UnknownAuthorityError](err); ok {
		return true
	}
	if _, ok := errors.AsType[x509.HostnameError](err); ok {
		return true
	}
	if _, ok := errors.AsType[x509.CertificateInvalidError](err); ok {
		return true
	}
	if _, ok := errors.AsType[tls.RecordHeaderError](err); ok {
		return true
	}
	op, ok := errors.AsType[*net.OpError](err)
	return ok && op.Op == "remote error" && strings.Contains(fmt.Sprint(op.Err), "tls:")
}

// webhookAnswer reads the answer to the probe. n8n lists the methods a
// path is registered for in Access-Control-Allow-Methods, answers 204 when
// POST is one of them and fails the preflight otherwise (a 500 with no
// reason in production, since it does not catch its own "not
// registered"); its test URL answers 404 "not registered". Any other
// receiver is judged by the status alone.
func webhookAnswer(i int, auth config.AuthType, where, path string, resp *http.Response, head []byte) admin.Check {
	status := resp.Status
	body := strings.TrimSpace(string(head))
	allow := resp.Header.Get("Access-Control-Allow-Methods")
	var methods []string
	for m := range strings.SplitSeq(allow, ",") {
		if m = strings.ToUpper(strings.TrimSpace(m)); m != "" && m != http.MethodOptions {
			methods = append(methods, m)
		}
	}
	webhookPath, _ := strings.CutPrefix(path, "/webhook/")
	code := resp.StatusCode
	switch {
	case body == n8nStartingUp:
		return admin.Check{Status: admin.Warn, Detail: fmt.Sprintf("n8n at %s is still starting (%q)", where, n8nStartingUp),
			Fix: "run doctor again once n8n logs \"Editor is now accessible via\""}
	case code < 300 && slices.Contains(methods, http.MethodPost):
		return admin.Check{Status: admin.OK, Detail: fmt.Sprintf("n8n webhook POST %s is registered (OPTIONS probe; nothing delivered)", path)}
	case code < 300:
		return admin.Check{Status: admin.OK, Detail: fmt.Sprintf("%s answered the OPTIONS probe with %s (nothing delivered; not recognised as n8n, so whether it takes the POST shows at the first delivery)", where, status)}
	case allow != "" && len(methods) > 0 && !slices.Contains(methods, http.MethodPost):
		return admin.Check{Status: admin.Fail, Detail: fmt.Sprintf("n8n webhook %s takes %s, not POST", path, strings.Join(methods, ", ")),
			Fix: "set the Webhook node's HTTP Method to POST, then publish the workflow again"}
	case allow != "" || (code == http.StatusNotFound && strings.Contains(body, "is not registered")):
		return admin.Check{Status: admin.Fail,
			Detail: fmt.Sprintf("n8n has no active workflow taking POST %s (answered %s): the workflow is not published, or the path is wrong", path, status),
			Fix: fmt.Sprintf("publish (activate) the workflow whose Webhook node has HTTP Method POST and Path %q (editor: Publish; CLI: n8n publish:workflow --id=ID, then restart n8n); "+
				"if it is published, copy the Webhook node's Production URL into sinks[%d].url", webhookPath, i)}
	case code == http.StatusUnauthorized || code == http.StatusForbidden:
		return admin.Check{Status: admin.Fail, Detail: fmt.Sprintf("%s answered %s to the probe, which carried the sink's credentials and headers", where, status),
			Fix: fmt.Sprintf("check sinks[%d].auth (type %s) and sinks[%d].headers: the receiver, or a proxy in front of it, refuses them", i, auth, i)}
	case code == http.StatusNotFound:
		return admin.Check{Status: admin.Fail, Detail: fmt.Sprintf("%s answered %s: %s", where, status, bodyText(head, 120)),
			Fix: fmt.Sprintf("check sinks[%d].url's path: for n8n it is the Webhook node's Production URL, http(s)://HOST/webhook/PATH", i)}
	case code >= 300 && code < 400:
		return admin.Check{Status: admin.Fail, Detail: fmt.Sprintf("%s redirects (%s) to %s: run does not follow redirects", where, status, resp.Header.Get("Location")),
			Fix: fmt.Sprintf("set sinks[%d].url to the final endpoint", i)}
	case code == http.StatusMethodNotAllowed || code == http.StatusNotImplemented:
		return admin.Check{Status: admin.OK, Detail: fmt.Sprintf("%s answered the OPTIONS probe with %s: it is up and takes other methods (nothing delivered)", where, status)}
	case code == http.StatusBadGateway || code == http.StatusServiceUnavailable || code == http.StatusGatewayTimeout:
		return admin.Check{Status: admin.Fail, Detail: fmt.Sprintf("%s answered %s: the receiver, or what a proxy in front of it forwards to, is down or overloaded", where, status),
			Fix: "start the receiver (for n8n: its main or webhook process) and check the proxy's upstream"}
	default:
		return admin.Check{Status: admin.Warn, Detail: fmt.Sprintf("%s answered the OPTIONS probe with %s: %s", where, status, bodyText(head, 120)),
			Fix: "check the receiver's log for this request (User-Agent: outbox-relay doctor)"}
	}
}
