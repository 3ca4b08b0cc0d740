package webhook

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay/notify"
)

// Notification formats: the body of a dead-letter notification
// (docs/operations.md, "Dead-letter notifications").
const (
	// NotifySlack is a Slack incoming-webhook message: "text" (which
	// Slack-compatible receivers such as Mattermost and Rocket.Chat show)
	// and the same text in "blocks", with a button to the console.
	NotifySlack = "slack"
	// NotifyJSON is the summary's fields as one JSON object.
	NotifyJSON = "json"
)

// NotifierConfig configures a Notifier. Zero fields take the sink's
// defaults.
type NotifierConfig struct {
	// URL is the absolute http:// or https:// endpoint. Required.
	URL string
	// Format is NotifySlack (or empty) or NotifyJSON.
	Format string
	// Timeout bounds one request, from dialling to reading the answer
	// (default 10s).
	Timeout time.Duration
	// Headers are sent on every request; Auth authenticates it, as a
	// sink's does (the id is the notification's).
	Headers map[string]string
	Auth    Auth
	Logger  zerolog.Logger
}

// Notifier posts dead-letter summaries to one URL with a webhook sink's
// conventions: its timeouts, its auth and headers, its reading of the
// answer (a 2xx accepted, anything else not), and never a request re-sent
// by net/http itself. It is notify.Sender.
type Notifier struct {
	s      *Sink
	format string
}

var _ notify.Sender = (*Notifier)(nil)

// NewNotifier validates cfg and returns a Notifier. It makes no request.
func NewNotifier(cfg NotifierConfig) (*Notifier, error) {
	switch cfg.Format {
	case "":
		cfg.Format = NotifySlack
	case NotifySlack, NotifyJSON:
	default:
		return nil, fmt.Errorf("notify: format %q is not one of %s, %s", cfg.Format, NotifySlack, NotifyJSON)
	}
	s, err := New(Config{Name: "notify", URL: cfg.URL, Timeout: cfg.Timeout, Concurrency: 1,
		Headers: cfg.Headers, Auth: cfg.Auth, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	if s.urlTmpl != nil {
		return nil, errors.New("notify: the url cannot hold {{ }}: a summary is about no one event")
	}
	return &Notifier{s: s, format: cfg.Format}, nil
}

// Send posts s once and returns nil when the receiver answered 2xx; any
// other answer, or none, is an error classified as a sink's (relay.Classify).
// The request ends with ctx or the timeout. Every send of one summary
// carries the same id (Idempotency-Key, webhook-id): the notification's,
// s.ID.
func (n *Notifier) Send(ctx context.Context, s notify.Summary) error {
	body, err := n.body(s)
	if err != nil {
		return err
	}
	id := IdempotencyKey("notify:"+s.ID(), 0)
	now := time.Now()
	req, trace, err := n.s.newRequest(ctx, n.s.url, body)
	if err != nil {
		return err
	}
	if err := n.s.authenticate(req, id, now, body, jwt.MapClaims{"notification": id, "sink": s.Sink}); err != nil {
		return err
	}
	label := fmt.Sprintf("notification of sink %q", s.Sink)
	resp, err := n.s.do(req, trace, label, 1, now)
	if err != nil {
		return err
	}
	defer drain(resp)
	return n.s.outcome(label, resp, now)
}

// Close releases the idle connections. Calling it again is safe.
func (n *Notifier) Close(ctx context.Context) error { return n.s.Close(ctx) }

// body renders s in the notifier's format.
func (n *Notifier) body(s notify.Summary) ([]byte, error) {
	var v any
	switch n.format {
	case NotifyJSON:
		v = jsonNotification(s)
	default:
		v = slackNotification(s)
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("notify: encode the %s body: %w", n.format, err)
	}
	if len(b) == 0 {
		return nil, errors.New("notify: empty body")
	}
	return b, nil
}

// notification is the json format.
type notification struct {
	Type         string         `json:"type"`
	ID           string         `json:"id"`
	Text         string         `json:"text"`
	Sink         string         `json:"sink"`
	Count        int            `json:"count"`
	Failed       int            `json:"failed"`
	Held         int            `json:"held"`
	More         bool           `json:"more"`
	Events       []notify.Event `json:"events"`
	LastError    string         `json:"last_error"`
	Since        time.Time      `json:"since"`
	Until        time.Time      `json:"until"`
	ListCommand  string         `json:"list_command"`
	RetryCommand string         `json:"retry_command"`
	ConsoleURL   string         `json:"console_url,omitempty"`
}

// NotificationType is the json format's "type".
const NotificationType = "outbox_relay.dead_letters"

func jsonNotification(s notify.Summary) notification {
	events := s.Events
	if events == nil {
		events = []notify.Event{}
	}
	return notification{
		Type: NotificationType, ID: s.ID(), Text: s.Headline(),
		Sink: s.Sink, Count: s.Count, Failed: s.Failed, Held: s.Held, More: s.More,
		Events: events, LastError: s.LastError, Since: s.Since.UTC(), Until: s.Until.UTC(),
		ListCommand: s.ListCommand(), RetryCommand: s.RetryCommand(), ConsoleURL: s.ConsoleURL,
	}
}

// maxShownKey is how much of an event key a Slack message shows.
const maxShownKey = 80

// slackNotification is the slack format: the text with Slack's mrkdwn,
// once as "text" and once in a section block, and the console's button.
func slackNotification(s notify.Summary) map[string]any {
	var b strings.Builder
	fmt.Fprintf(&b, "*%s*\n", slackEscape(s.Headline()))
	if len(s.Events) > 0 {
		b.WriteString("First: ")
		for i, e := range s.Events {
			if i > 0 {
				b.WriteString(", ")
			}
			key := e.EventKey
			if len(key) > maxShownKey {
				key = strings.ToValidUTF8(key[:maxShownKey], "") + "…"
			}
			fmt.Fprintf(&b, "%d `%s` (%s)", e.ID, slackEscape(strings.ReplaceAll(key, "`", "'")), e.Status)
		}
		if s.Count > len(s.Events) {
			fmt.Fprintf(&b, ", and %d more", s.Count-len(s.Events))
		}
		b.WriteString("\n")
	}
	if s.LastError != "" {
		fmt.Fprintf(&b, "Last error: %s\n", slackEscape(s.LastError))
	}
	fmt.Fprintf(&b, "Settled %s to %s\n", s.Since.UTC().Format(time.RFC3339), s.Until.UTC().Format(time.RFC3339))
	fmt.Fprintf(&b, "List: `%s`\nRetry: `%s`", slackEscape(s.ListCommand()), slackEscape(s.RetryCommand()))
	if s.ConsoleURL != "" {
		fmt.Fprintf(&b, "\nConsole: <%s|open the console>", slackEscape(s.ConsoleURL))
	}
	text := b.String()
	blocks := []any{map[string]any{"type": "section", "text": map[string]any{"type": "mrkdwn", "text": text}}}
	if s.ConsoleURL != "" {
		blocks = append(blocks, map[string]any{"type": "actions", "elements": []any{map[string]any{
			"type": "button", "text": map[string]any{"type": "plain_text", "text": "Open the console"}, "url": s.ConsoleURL,
		}}})
	}
	return map[string]any{"text": text, "blocks": blocks}
}

// slackEscape escapes the three characters Slack's mrkdwn reserves.
func slackEscape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;").Replace(s)
}
