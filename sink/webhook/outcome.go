package webhook

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/relay"
)

// n8nStartingUp is the body n8n sends, with status 200, while it starts.
const n8nStartingUp = "n8n is starting up. Please wait"

// outcome classifies a response as the package documentation's table says;
// label names what the request carried (`event "k"`, or a batch). A failure
// carries the response's status for the relay's log.
func (s *Sink) outcome(label string, resp *http.Response, now time.Time) error {
	err := s.classify(label, resp, now)
	var de *relay.DeliveryError
	if resp.StatusCode >= 300 && errors.As(err, &de) {
		de.Status = resp.StatusCode
	}
	return err
}

func (s *Sink) classify(label string, resp *http.Response, now time.Time) error {
	code := resp.StatusCode
	if code >= 200 && code < 300 {
		// n8n answers 200 "n8n is starting up. Please wait" to every request
		// while it migrates its database at start: the workflow did not run,
		// so that answer must not count as delivered.
		head, _ := io.ReadAll(io.LimitReader(resp.Body, int64(len(n8nStartingUp))+8))
		if bytes.Equal(bytes.TrimSpace(head), []byte(n8nStartingUp)) {
			return relay.TransientError(fmt.Errorf("webhook %s: %s: n8n answered %d %q: it is still starting, the workflow did not run",
				s.name, label, code, n8nStartingUp), time.Second)
		}
		return nil
	}
	var head []byte
	if code >= 400 {
		head, _ = io.ReadAll(io.LimitReader(resp.Body, headLimit))
	}
	retryAfter := parseRetryAfter(resp.Header.Get("Retry-After"), now)
	status := strconv.Itoa(code)
	if text := http.StatusText(code); text != "" {
		status += " " + text
	}
	prefix := fmt.Sprintf("webhook %s: %s: receiver answered %s", s.name, label, status)
	switch {
	case code == http.StatusUnauthorized || code == http.StatusForbidden:
		return relay.SinkDownError(fmt.Errorf("webhook %s: receiver answered %s: check the sink's credentials (auth type %s)",
			s.name, status, s.auth.Type), retryAfter)
	case code == http.StatusNotFound && bytes.Contains(head, []byte("is not registered")):
		return relay.SinkDownError(fmt.Errorf("webhook %s: receiver answered %s, the n8n webhook is not registered: "+
			"publish (activate) the n8n workflow, and use its production URL (/webhook/…, not /webhook-test/…)",
			s.name, status), retryAfter)
	case code == http.StatusNotFound:
		// The URL does not exist (yet): n8n answers "Cannot POST …" while it
		// registers its webhooks at start, a proxy before the route exists.
		// Every event would get the same answer, so it is the sink's problem,
		// not the event's: open the circuit instead of dead-lettering.
		return relay.SinkDownError(fmt.Errorf("webhook %s: receiver answered %s: %s: check the sink's url (for n8n: the workflow must be published and the URL its production /webhook/… one)",
			s.name, status, excerpt(head)), retryAfter)
	case code == http.StatusConflict && s.treat409:
		return nil
	case s.permanent[code]:
		return relay.PermanentError(fmt.Errorf("%s: %s", prefix, excerpt(head)))
	case code == http.StatusRequestTimeout, code == http.StatusTooEarly, code == http.StatusTooManyRequests,
		code == http.StatusConflict, code >= 500:
		return relay.TransientError(fmt.Errorf("%s: %s", prefix, excerpt(head)), retryAfter)
	case code >= 400:
		// Any other 4xx (405, 410, ...)
		// says the request itself is wrong; repeating it cannot help.
		return relay.PermanentError(fmt.Errorf("%s: %s", prefix, excerpt(head)))
	case code >= 300 && code < 400:
		return relay.TransientError(fmt.Errorf("%s: redirects are not followed, set the sink's url to the final endpoint", prefix), retryAfter)
	default:
		return relay.TransientError(errors.New(prefix), retryAfter)
	}
}

// parseRetryAfter returns the delay a Retry-After value asks for, in either
// form (delta-seconds or HTTP-date), capped at maxRetryAfter; 0 when absent,
// invalid or in the past.
func parseRetryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseUint(v, 10, 64); err == nil || errors.Is(err, strconv.ErrRange) {
		if err != nil || secs > uint64(maxRetryAfter/time.Second) {
			return maxRetryAfter
		}
		return time.Duration(secs) * time.Second
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0
	}
	return min(max(t.Sub(now), 0), maxRetryAfter)
}

// excerpt renders the start of a response body as one line: at most
// excerptLimit bytes, invalid UTF-8 replaced, control characters and runs
// of white space turned into single spaces.
func excerpt(b []byte) string {
	truncated := len(b) > excerptLimit
	if truncated {
		cut := excerptLimit
		for cut > 0 && !utf8.RuneStart(b[cut]) {
			cut--
		}
		b = b[:cut]
	}
	s := strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(string(b), "\uFFFD"))
	s = strings.Join(strings.Fields(s), " ")
	if s == "" {
		return "(empty body)"
	}
	if truncated {
		s += " …"
	}
	return s
}
