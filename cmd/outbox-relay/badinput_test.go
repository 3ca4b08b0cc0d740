package main

// The bad-input suite (docs/guarantees.md, "bad input never stops the stream"): each class of bad input, end to end
// through the relay against a real PostgreSQL, an embedded NATS server and a
// webhook receiver. Every test asserts the exact outcome — a dead letter
// whose reason names the cause, a clear error, or a faithful delivery where
// the input is legal — and that events published after the bad one still
// reach every sink.

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// TestBadInput_Oversize: an event over the NATS server's max_payload, and
// one over the webhook sink's max_body, on both paths. Each is dead-lettered
// (status failed) with a reason naming the sink, the size and the limit,
// without being sent to that sink; the other sink gets it; later events of
// the same aggregate and of others reach both sinks.
func TestBadInput_Oversize(t *testing.T) {
	type limitCase struct {
		name      string
		natsLimit int32  // the server's max_payload; 0: default (1 MiB)
		hookExtra string // webhook sink YAML
		pad       int    // payload padding: over the one limit, under the other
		over      string // the sink whose limit the event passes
		reason    *regexp.Regexp
	}
	cases := []limitCase{
		{"nats max_payload", 64 << 10, "", 100_000, "nats",
			regexp.MustCompile(`sink nats: .*message is \d{6} bytes \(headers included\), over the server's max_payload of 65536`)},
		{"webhook max_body", 0, "    max_body: 32KiB", 40_000, "hook",
			regexp.MustCompile(`sink hook: .*body is \d{5} bytes, over the sink's max_body of 32768 bytes`)},
	}
	for _, mode := range []string{"replication", "poll"} {
		for _, tc := range cases {
			t.Run(mode+"/"+tc.name, func(t *testing.T) {
				s := newSetup(t, pgtest.NewDatabase(t))
				if tc.natsLimit > 0 {
					s.nats = natstest.Start(t, natstest.WithMaxPayload(tc.natsLimit))
				}
				s.biRun(t, s.configFileWith(t, tc.hookExtra, biSource(mode)))
				if mode == "replication" {
					s.waitSlot(t)
				}
				s.biPublish(t, "order.placed", "order", "A", "before-1", `{"n": 1}`)
				big := fmt.Sprintf(`{"pad": %q}`, strings.Repeat("x", tc.pad))
				s.biPublish(t, "order.placed", "order", "A", "big", big)
				s.biPublish(t, "order.placed", "order", "A", "after-1", `{"n": 2}`)
				s.biPublish(t, "order.placed", "order", "B", "after-2", `{"n": 3}`)

				other := map[string]string{"nats": "hook", "hook": "nats"}[tc.over]
				s.biWaitFailed(t, "big", tc.reason)
				s.biWaitDelivered(t, other, "big")
				s.biFlows(t, "before-1", "after-1", "after-2")
				if got := s.biLedger(t, "big"); got[tc.over] != "" || got[other] != "delivered" {
					t.Fatalf("ledger of the oversize event: %v; want %s delivered and nothing for %s", got, other, tc.over)
				}
				if n := len(s.biAt(t, tc.over)["big"]); n != 0 {
					t.Fatalf("%s received the oversize event %d times", tc.over, n)
				}
				body := s.biAt(t, other)["big"]
				if len(body) != 1 || !strings.Contains(body[0].Body, strings.Repeat("x", tc.pad)) {
					t.Fatalf("%s: the oversize event arrived %d times or truncated", other, len(body))
				}
			})
		}
	}
}

// TestBadInput_EmptyEventKey: the schema allows an empty event_key (NOT
// NULL, no CHECK), but an empty key cannot identify an event: every such
// event would share one ledger pair, one webhook-id and one Nats-Msg-Id, so
// a second one would be taken for a duplicate and never delivered. The row
// is dead-lettered with a reason naming the empty key, on both paths, and
// nothing is sent; the events behind it flow.
func TestBadInput_EmptyEventKey(t *testing.T) {
	for _, mode := range []string{"replication", "poll"} {
		t.Run(mode, func(t *testing.T) {
			s := newSetup(t, pgtest.NewDatabase(t))
			s.biRun(t, s.configFileWith(t, "", biSource(mode)))
			if mode == "replication" {
				s.waitSlot(t)
			}
			s.biPublish(t, "order.placed", "order", "E", "empty-before", `{}`)
			s.biPublish(t, "order.placed", "order", "E", "", `{"empty": true}`)
			s.biPublish(t, "order.placed", "order", "E", "empty-after", `{}`)

			s.biWaitFailed(t, "", regexp.MustCompile(`sink (nats|hook): .*empty event_key`))
			_, lastError := s.biRow(t, "")
			for _, sink := range []string{"nats", "hook"} {
				if !strings.Contains(lastError, "sink "+sink+":") {
					t.Errorf("last_error %q does not name sink %s", lastError, sink)
				}
				if n := len(s.biAt(t, sink)[""]); n != 0 {
					t.Errorf("%s received the event with the empty key %d times", sink, n)
				}
			}
			if got := s.biLedger(t, ""); len(got) != 0 {
				t.Fatalf("ledger rows for the empty key: %v", got)
			}
			s.biFlows(t, "empty-before", "empty-after")
		})
	}
}

// TestBadInput_PayloadShapes: payloads that are not JSON objects are legal
// jsonb — a string, an array, a number, JSON null, and SQL NULL — and are
// delivered byte-faithfully (jsonb's text form, the same bytes at both
// sinks); a payload jsonb refuses never becomes a row.
func TestBadInput_PayloadShapes(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.biRun(t, s.configFile(t, ""))
	s.waitSlot(t)

	payloads := map[string]*string{
		"shape-string": ptr(`"just a string with \"quotes\" and \\ and é"`),
		"shape-array":  ptr(`[1, "two", {"three": [3]}, null, true]`),
		"shape-number": ptr(`1.50`),
		"shape-null":   ptr(`null`),
		"shape-sql":    nil, // SQL NULL
		"shape-deep":   ptr(`{"a": {"b": {"c": "🎉 \u2028 line separator"}}, "empty": {}}`),
	}
	ctx := context.Background()
	for key, p := range payloads {
		if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('shape.test', 'shape', 'S', $1, $2::jsonb)`, key, p); err != nil {
			t.Fatalf("publish %s: %v", key, err)
		}
	}
	_, err := s.pool.Exec(ctx, `SELECT outbox_publish('shape.test', 'shape', 'S', 'shape-invalid', '{"a": "\u0000"}'::jsonb)`)
	if err == nil || !strings.Contains(err.Error(), "unsupported Unicode escape sequence") {
		t.Fatalf("a payload with \\u0000: %v, want jsonb's refusal", err)
	}
	s.biPublish(t, "shape.test", "shape", "S", "shape-after", `{}`)

	keys := []string{"shape-after"}
	for key := range payloads {
		keys = append(keys, key)
	}
	s.biFlows(t, keys...)
	hook, msgs := s.biAt(t, "hook"), s.biAt(t, "nats")
	for key := range payloads {
		var want string
		if err := s.pool.QueryRow(ctx, `SELECT coalesce(payload::text, 'null') FROM integration_outbox WHERE event_key = $1`, key).Scan(&want); err != nil {
			t.Fatal(err)
		}
		h, m := hook[key][0].Body, msgs[key][0].Body
		if h != m {
			t.Errorf("%s: webhook and NATS bodies differ:\n%s\n%s", key, h, m)
		}
		if !strings.Contains(h, `,"payload":`+want+`,"created_at":`) {
			t.Errorf("%s: body %s does not carry the payload %s verbatim", key, h, want)
		}
		if !json.Valid([]byte(h)) {
			t.Errorf("%s: body is not valid JSON: %s", key, h)
		}
	}
}

// TestBadInput_UnicodeKeysAndTypes: unicode and emoji in keys, types and
// aggregates are legal and delivered to both sinks: the envelope carries
// them verbatim, the webhook-id is the key when it is header-safe and a
// stable printable-ASCII id otherwise, NATS headers carry them verbatim or
// b64-encoded when they are not plain header text, and the subject is the
// sanitised but deterministic rendering of the type and aggregate.
func TestBadInput_UnicodeKeysAndTypes(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.biRun(t, s.configFile(t, ""))
	s.waitSlot(t)

	events := []struct {
		key, typ, aggType, aggID string
		subject                  string
	}{
		{"ключ-🔑-1", "заказ.создан", "Bestellung📦", "Ä-1", "outbox.Bestellung📦.заказ_создан"},
		{"注文-✓", "注文.作成", "注文", "1", "outbox.注文.注文_作成"},
		{"emoji 🎉 with spaces", "party 🎉", "fête", "É", "outbox.fête.party_🎉"},
		{" leading and trailing space ", "tab\there", "agg\nline", "x", "outbox.agg_line.tab_here"},
		{"evk_looks-mapped", "ok", "ok", "1", "outbox.ok.ok"},
		{"plain-ascii-key", "ok.type", "ok", "1", "outbox.ok.ok_type"},
		{strings.Repeat("長", 100), "long.key", "long", "1", "outbox.long.long_key"},
	}
	for _, e := range events {
		s.biPublish(t, e.typ, e.aggType, e.aggID, e.key, `{"k": "`+strings.ReplaceAll(e.key, "\t", `\t`)+`"}`)
	}
	s.biPublish(t, "ok", "ok", "2", "unicode-after", `{}`)
	keys := []string{"unicode-after"}
	for _, e := range events {
		keys = append(keys, e.key)
	}
	s.biFlows(t, keys...)

	hook := s.biAt(t, "hook")
	msgs := biJetStream(t, s.nats)
	for _, e := range events {
		h := hook[e.key]
		if len(h) != 1 {
			t.Fatalf("%q: %d webhook requests", e.key, len(h))
		}
		if want := webhook.IdempotencyKey(e.key, 0); h[0].IdemKey != want || !printableASCII(h[0].IdemKey) {
			t.Errorf("%q: webhook-id %q, want %q (printable ASCII)", e.key, h[0].IdemKey, want)
		}
		var env struct {
			EventKey      string `json:"event_key"`
			EventType     string `json:"event_type"`
			AggregateType string `json:"aggregate_type"`
			AggregateID   string `json:"aggregate_id"`
		}
		if err := json.Unmarshal([]byte(h[0].Body), &env); err != nil {
			t.Fatalf("%q: body %s: %v", e.key, h[0].Body, err)
		}
		if env.EventKey != e.key || env.EventType != e.typ || env.AggregateType != e.aggType || env.AggregateID != e.aggID {
			t.Errorf("%q: envelope carries %+v", e.key, env)
		}
		m, ok := msgs[e.key]
		if !ok {
			t.Fatalf("%q: no NATS message", e.key)
		}
		if m.Subject != e.subject {
			t.Errorf("%q: subject %q, want %q", e.key, m.Subject, e.subject)
		}
		if string(m.Data) != h[0].Body {
			t.Errorf("%q: NATS data and webhook body differ", e.key)
		}
		if got, want := m.Header.Get(jetstream.MsgIDHeader), s.deployment(t).MsgID(&relay.Delivery{Event: &relay.Event{ID: 1, EventKey: e.key}}); got != want {
			t.Errorf("%q: Nats-Msg-Id %q, want %q", e.key, got, want)
		}
		if got, want := m.Header.Get(natssink.HeaderEventType), natssink.HeaderValue(e.typ); got != want {
			t.Errorf("%q: %s %q, want %q", e.key, natssink.HeaderEventType, got, want)
		}
	}
}

// TestBadInput_SubjectCharacters: characters NATS forbids in a subject token
// ('.', '*', '>', white space, control characters) and NULL or empty fields
// become '_' — deterministically, so one aggregate always maps to one
// subject. A subject too long for the protocol line is dead-lettered for
// NATS with the reason, and the webhook still gets the event.
func TestBadInput_SubjectCharacters(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.biRun(t, s.configFile(t, ""))
	s.waitSlot(t)

	events := []struct {
		key           string
		typ, aggType  *string
		subject       string
		deadForNATS   bool
		reasonPattern string
	}{
		{key: "subj-dots", typ: ptr("a.b.c"), aggType: ptr("x.y"), subject: "outbox.x_y.a_b_c"},
		{key: "subj-wild", typ: ptr("*"), aggType: ptr(">"), subject: "outbox._._"},
		{key: "subj-mixed", typ: ptr("order.*.>"), aggType: ptr("two words\tand\ttabs"), subject: "outbox.two_words_and_tabs.order____"},
		{key: "subj-control", typ: ptr("bell\x07del\x7f"), aggType: ptr("cr\rlf\n"), subject: "outbox.cr_lf_.bell_del_"},
		{key: "subj-null", typ: nil, aggType: nil, subject: "outbox._._"},
		{key: "subj-empty", typ: ptr(""), aggType: ptr(""), subject: "outbox._._"},
		{key: "subj-long", typ: ptr("t"), aggType: ptr(strings.Repeat("a", 4000)), deadForNATS: true, reasonPattern: `sink nats: .*subject is \d+ bytes, more than 3072`},
	}
	ctx := context.Background()
	for _, e := range events {
		if _, err := s.pool.Exec(ctx, `SELECT outbox_publish($1, $2, 'S', $3, '{}')`, e.typ, e.aggType, e.key); err != nil {
			t.Fatalf("publish %s: %v", e.key, err)
		}
	}
	s.biPublish(t, "ok", "ok", "1", "subj-after", `{}`)

	var flowing []string
	for _, e := range events {
		if e.deadForNATS {
			s.biWaitFailed(t, e.key, regexp.MustCompile(e.reasonPattern))
			s.biWaitDelivered(t, "hook", e.key)
			continue
		}
		flowing = append(flowing, e.key)
	}
	s.biFlows(t, append(flowing, "subj-after")...)
	msgs := biJetStream(t, s.nats)
	for _, e := range events {
		m, ok := msgs[e.key]
		switch {
		case e.deadForNATS && ok:
			t.Errorf("%s: published despite its subject (%d bytes)", e.key, len(m.Subject))
		case !e.deadForNATS && m.Subject != e.subject:
			t.Errorf("%s: subject %q, want %q", e.key, m.Subject, e.subject)
		}
	}
}

// TestBadInput_NATSAuthFailure: the NATS server refuses the relay's
// credentials (a wrong token; a wrong password in the URL). Like a webhook's
// 401, that is a sink-level failure, not a reason to stop the relay: it
// starts, logs an error naming the sink and the authorization failure,
// /readyz answers 200 with a line naming the sink down and why, the webhook keeps getting every
// event, and the NATS side of each event waits on the claim path (pending,
// diverted, no attempt counted, never dead-lettered). Once the credentials
// are fixed and the relay restarted, NATS gets every event and the webhook
// gets no repeat.
func TestBadInput_NATSAuthFailure(t *testing.T) {
	for _, tc := range []struct {
		name string
		opt  natstest.Option
		// sink returns the NATS sink's settings with the right or a wrong
		// credential.
		sink func(url string, right bool) biConfig
	}{
		{"token", natstest.WithToken("right-token"), func(url string, right bool) biConfig {
			return biConfig{natsURL: url, natsExtra: `    token: "` + map[bool]string{true: "right", false: "wrong"}[right] + `-token"`}
		}},
		{"user and password", natstest.WithUserPassword("relay", "right-password"), func(url string, right bool) biConfig {
			password := map[bool]string{true: "right", false: "wrong"}[right] + "-password"
			return biConfig{natsURL: strings.Replace(url, "nats://", "nats://relay:"+password+"@", 1)}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSetup(t, pgtest.NewDatabase(t))
			s.nats = natstest.Start(t, tc.opt)

			cfg := s.biConfigFile(t, tc.sink(s.nats.URL(), false))
			if code, out, _ := execute(t, "doctor", "--config", cfg); code != exitFailure ||
				!regexp.MustCompile(`FAIL  sink nats .*(?i:authorization violation)`).MatchString(out) {
				t.Errorf("doctor: exit %d, want %d and the sink's authorization failure:\n%s", code, exitFailure, out)
			}
			r := s.biRun(t, cfg)
			eventually(t, 30*time.Second, "the relay to log the refused credentials", func() bool {
				r.alive(t)
				return strings.Contains(strings.ToLower(r.logs.String()), "authorization violation")
			})
			s.waitSlot(t)
			// The relay is ready (it delivers to the webhook); the body
			// names the sink that is down and why.
			code, body := biReadyz(t, r.addr(t))
			if code != http.StatusOK || !strings.Contains(body, "sink nats is down") || !strings.Contains(strings.ToLower(body), "authorization") {
				t.Fatalf("/readyz: %d %q; want 200 naming the nats sink and the authorization failure", code, body)
			}
			if strings.Contains(r.logs.String(), "wrong-") {
				t.Fatal("the log shows the wrong credential")
			}
			for i := range 6 {
				s.biPublish(t, "order.placed", "order", fmt.Sprint(i%2), fmt.Sprintf("auth-%d", i), `{}`)
			}
			keys := s.keys(t, "true")
			eventually(t, 30*time.Second, "every event at the webhook and waiting for NATS on the claim path", func() bool {
				hook := s.biAt(t, "hook")
				for k := range keys {
					if len(hook[k]) == 0 {
						return false
					}
				}
				return s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE status = 'pending' AND handoff_at IS NOT NULL
					AND attempts = 0 AND last_error LIKE 'sink nats: %'`) == int64(len(keys))
			})
			// An event sent to the sink meets the refusal; the ones behind it
			// find the circuit open (the log and /readyz say why).
			if s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE last_error LIKE '%nats: Authorization Violation%'`) == 0 {
				t.Fatal("no row's last_error names the authorization failure")
			}
			if n := s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE status = 'failed'"); n != 0 {
				t.Fatalf("%d rows dead-lettered while NATS refused the credentials", n)
			}
			r.stop()

			r = s.biRun(t, s.biConfigFile(t, tc.sink(s.nats.URL(), true)))
			s.biFlows(t, slices.Collect(maps.Keys(keys))...)
			if code, body := biReadyz(t, r.addr(t)); code != http.StatusOK {
				t.Fatalf("/readyz with the right credentials: %d %q", code, body)
			}
			for k, ds := range s.biAt(t, "hook") {
				if len(ds) != 1 {
					t.Fatalf("webhook got %q %d times", k, len(ds))
				}
			}
			eventually(t, 10*time.Second, "every row done", func() bool {
				return s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE status <> 'done'") == 0
			})
		})
	}
}

// TestBadInput_UnresolvableWebhook: the webhook's host does not resolve
// (.invalid, RFC 6761). Every event would fail alike, so the sink counts as
// down: its circuit opens, the relay logs the error naming the host, the
// events wait on the claim path without counting attempts (with
// max_attempts 2 they would otherwise be dead letters within a second), and
// NATS keeps getting every event. Pointed at a receiver that resolves, the
// relay delivers them all.
func TestBadInput_UnresolvableWebhook(t *testing.T) {
	const host = "outbox-relay-badinput.invalid"
	s := newSetup(t, pgtest.NewDatabase(t))
	tight := "{max_attempts: 2, inline_attempts: 2, backoff: [100ms]}"
	r := s.biRun(t, s.biConfigFile(t, biConfig{hookURL: "http://" + host + "/webhook/outbox", delivery: tight,
		top: "source: {poll_interval: 200ms}"}))
	s.waitSlot(t)
	for i := range 6 {
		s.biPublish(t, "order.placed", "order", fmt.Sprint(i%2), fmt.Sprintf("dns-%d", i), `{}`)
	}
	keys := slices.Collect(maps.Keys(s.keys(t, "true")))
	eventually(t, 30*time.Second, "every event at NATS", func() bool {
		got := s.biAt(t, "nats")
		for _, k := range keys {
			if len(got[k]) == 0 {
				return false
			}
		}
		return true
	})
	// The claim path has tried the webhook again, twice, and still found
	// the host missing: by then a counted failure would have dead-lettered
	// the events. Each pass that finds the sink down puts the row back with
	// a later available_at (the circuit's next probe) and no attempt: two
	// changes of dns-0's available_at are two passes.
	dueOf := func() int64 {
		return s.scalar(t, `SELECT coalesce((SELECT (extract(epoch FROM available_at) * 1e6)::bigint FROM integration_outbox
			WHERE event_key = 'dns-0' AND handoff_at IS NOT NULL AND status = 'pending'), 0)`)
	}
	seen := map[int64]bool{}
	eventually(t, 30*time.Second, "the claim path to find the webhook down twice", func() bool {
		r.alive(t)
		if n := s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE status = 'failed' OR attempts > 0"); n != 0 {
			t.Fatalf("%d events dead-lettered or counted an attempt because the webhook's host does not resolve", n)
		}
		if d := dueOf(); d != 0 {
			seen[d] = true
		}
		return len(seen) >= 3
	})
	// The stream hands the events behind the first ones off once the
	// circuit is open; those diversions settle a moment later.
	waiting := func() int64 {
		return s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE status = 'pending' AND handoff_at IS NOT NULL
		AND attempts = 0 AND last_error LIKE 'sink hook: %'`)
	}
	eventually(t, 10*time.Second, "every event waiting on the claim path", func() bool { return waiting() == int64(len(keys)) })
	if n := s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE status = 'failed' OR attempts > 0"); n != 0 {
		t.Fatalf("%d events failed or counted an attempt because the webhook's host does not resolve", n)
	}
	if s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE last_error LIKE '%`+host+`%'`) == 0 {
		t.Fatalf("no last_error names the host %s", host)
	}
	r.stop()

	s.biRun(t, s.biConfigFile(t, biConfig{delivery: tight, top: "source: {poll_interval: 200ms}"}))
	s.biFlows(t, keys...)
	for sink := range map[string]bool{"hook": true, "nats": true} {
		for k, ds := range s.biAt(t, sink) {
			if len(ds) != 1 {
				t.Fatalf("%s got %q %d times", sink, k, len(ds))
			}
		}
	}
}

// TestBadInput_MissingGrants: run as a role that lacks a privilege it needs.
// A missing table privilege stops run at start (exit 1) with an error naming
// the role, the privilege, the table and the GRANT that fixes it; doctor
// prints the same GRANT. A role without REPLICATION stops run in
// source.mode replication with the ALTER ROLE fix, and in auto mode the
// relay polls instead and every event flows.
func TestBadInput_MissingGrants(t *testing.T) {
	const (
		outbox = `"public"."integration_outbox"`
		ledger = `"public"."integration_idempotency"`
		ckpt   = `"public"."relay_checkpoint"`
		pauses = `"public"."integration_outbox_relay_pauses"`
	)
	all := func(except string) []string {
		grants := []string{
			"GRANT USAGE ON SCHEMA public TO {{role}}",
			"GRANT SELECT, UPDATE, DELETE ON " + outbox + " TO {{role}}",
			"GRANT SELECT, INSERT, UPDATE, DELETE ON " + ledger + ", " + ckpt + " TO {{role}}",
			"GRANT SELECT ON " + pauses + " TO {{role}}",
		}
		if except != "" {
			grants = append(grants, except)
		}
		return grants
	}
	for _, tc := range []struct {
		name   string
		attrs  string
		grants []string
		mode   string
		want   []string // in run's error
		fix    string   // in doctor's output
	}{
		{name: "no SELECT on the outbox", attrs: "REPLICATION", grants: all("REVOKE SELECT ON " + outbox + " FROM {{role}}"), mode: "replication",
			want: []string{"lacks SELECT", "public.integration_outbox", `GRANT SELECT ON ` + outbox + ` TO`}, fix: `GRANT SELECT ON ` + outbox + ` TO`},
		{name: "no INSERT on the ledger", attrs: "REPLICATION", grants: all("REVOKE INSERT ON " + ledger + " FROM {{role}}"), mode: "replication",
			want: []string{"lacks INSERT", "public.integration_idempotency", `GRANT INSERT ON ` + ledger + ` TO`}, fix: `GRANT INSERT ON ` + ledger + ` TO`},
		{name: "no REPLICATION in replication mode", grants: all(""), mode: "replication",
			want: []string{"REPLICATION", "ALTER ROLE"}, fix: `WITH REPLICATION;`},
		{name: "no REPLICATION in auto mode", grants: all(""), mode: "auto", fix: `WITH REPLICATION;`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSetup(t, pgtest.NewDatabase(t))
			roleURL, role := biRole(t, s, tc.attrs, tc.grants...)
			cfg := s.biConfigFile(t, biConfig{databaseURL: roleURL, top: fmt.Sprintf("source: {mode: %s, poll_interval: 200ms}", tc.mode)})

			code, out, errOut := execute(t, "doctor", "--config", cfg)
			if code != exitFailure || !strings.Contains(out, tc.fix) || !strings.Contains(out, relay.QuoteIdentifier(role)) {
				t.Errorf("doctor: exit %d, want %d and the fix %q for %s:\n%s%s", code, exitFailure, tc.fix, role, out, errOut)
			}

			if tc.want == nil {
				r := s.biRun(t, cfg)
				eventually(t, 30*time.Second, "the relay to fall back to polling", func() bool {
					r.alive(t)
					return strings.Contains(r.logs.String(), "replication unavailable")
				})
				if !strings.Contains(r.logs.String(), "REPLICATION") {
					t.Errorf("the fallback's log line does not name REPLICATION:\n%s", r.logs.String())
				}
				if code, body := biReadyz(t, r.addr(t)); code != http.StatusOK {
					t.Errorf("/readyz while polling: %d %q", code, body)
				}
				s.biPublish(t, "order.placed", "order", "1", "grants-1", `{}`)
				s.biPublish(t, "order.placed", "order", "1", "grants-2", `{}`)
				s.biFlows(t, "grants-1", "grants-2")
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			var stdout, stderr syncBuffer
			code = Execute(ctx, []string{"run", "--config", cfg}, &stdout, &stderr)
			if ctx.Err() != nil {
				t.Fatalf("run was still running after 20s:\n%s", biTail(stderr.String(), 4000))
			}
			if code != exitFailure {
				t.Errorf("run: exit %d, want %d", code, exitFailure)
			}
			if i := strings.LastIndex(stderr.String(), "outbox-relay: "); i >= 0 {
				t.Logf("run: exit %d: %s", code, strings.TrimSpace(stderr.String()[i:]))
			}
			for _, w := range append(tc.want, role) {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("run's output lacks %q:\n%s", w, biTail(stderr.String(), 4000))
				}
			}
		})
	}
}

// biRole creates a login role with attrs for the test, named after its
// database (roles are cluster-wide), runs the statements ({{role}} is its
// quoted name) and returns a URL of the test database that connects as it.
// The role is dropped when the test ends.
func biRole(t *testing.T, s *setup, attrs string, stmts ...string) (roleURL, role string) {
	t.Helper()
	ctx := context.Background()
	var db string
	if err := s.pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	role = db + "_role"
	q := relay.QuoteIdentifier(role)
	if _, err := s.pool.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN %s", q, attrs)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, stmt := range []string{"DROP OWNED BY " + q, "DROP ROLE " + q} {
			if _, err := s.pool.Exec(context.Background(), stmt); err != nil {
				t.Errorf("%s: %v", stmt, err)
			}
		}
	})
	for _, stmt := range stmts {
		stmt = strings.ReplaceAll(stmt, "{{role}}", q)
		if _, err := s.pool.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	return withUser(t, s.url, role), role
}

// TestBadInput_InvalidConfig: each class of configuration error stops run
// before it connects anywhere, with the configuration exit code (2) and a
// message naming the key, with the file and line where there is one; config
// and doctor refuse the same file alike.
func TestBadInput_InvalidConfig(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "no-such-secret")
	const hook = "sinks:\n  - name: hook\n    type: webhook\n    url: http://127.0.0.1:9/hook\n"
	for _, tc := range []struct {
		name string
		yaml string
		env  map[string]string
		want []string
	}{
		{"YAML syntax error", "source:\n  mode: poll\n   slot: x\n", nil, []string{"relay.yaml", "line 3"}},
		{"unknown key", "source:\n  mode: poll\n  pol_interval: 1s\n", nil,
			[]string{"relay.yaml:3", "unknown key source.pol_interval", "did you mean source.poll_interval"}},
		{"wrong type", "source:\n  batch_size: many\n", nil, []string{"relay.yaml:2", "source.batch_size"}},
		{"bad duration", "source:\n  poll_interval: fast\n", nil, []string{"relay.yaml:2", "source.poll_interval", "fast"}},
		{"bad enum", "source:\n  mode: sometimes\n", nil, []string{"relay.yaml:2", "source.mode", "sometimes"}},
		{"bad URL", "sinks:\n  - name: hook\n    type: webhook\n    url: ftp://example.com/hook\n", nil, []string{"relay.yaml:4", "sinks[0].url"}},
		{"missing required key", "sinks:\n  - type: webhook\n    url: http://127.0.0.1:9/hook\n", nil, []string{"relay.yaml:2", "sinks[0].name", "required"}},
		{"secret file missing", hook + "    auth: {type: jwt, secret_file: " + missing + "}\n", nil, []string{"sinks[0].auth.secret_file", missing}},
		{"unset variable", "database_url: ${BADINPUT_UNSET_DATABASE_URL}\n", nil, []string{"relay.yaml:1", "BADINPUT_UNSET_DATABASE_URL"}},
		{"invalid RELAY_ override", "source:\n  mode: poll\n", map[string]string{"RELAY_SOURCE_POLL_INTERVAL": "soon"},
			[]string{"RELAY_SOURCE_POLL_INTERVAL", "source.poll_interval", "soon"}},
		{"unknown RELAY_ variable", "source:\n  mode: poll\n", map[string]string{"RELAY_SOURCE_POLL_INTERVALL": "1s"},
			[]string{"RELAY_SOURCE_POLL_INTERVALL"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "relay.yaml")
			if err := os.WriteFile(path, []byte(tc.yaml), 0o600); err != nil {
				t.Fatal(err)
			}
			for _, cmd := range []string{"run", "config", "doctor"} {
				code, _, errOut := biExecute(t, tc.env, cmd, "--config", path)
				if code != exitUsage {
					t.Errorf("%s: exit %d, want %d (configuration); stderr:\n%s", cmd, code, exitUsage, errOut)
				}
				for _, w := range tc.want {
					if !strings.Contains(errOut, w) {
						t.Errorf("%s: stderr lacks %q:\n%s", cmd, w, errOut)
					}
				}
				if cmd == "run" {
					t.Logf("run: exit %d: %s", code, strings.TrimSpace(errOut))
				}
			}
		})
	}
}

// biExecute runs the command line in-process with only env's RELAY_*
// variables set (and no DATABASE_URL).
func biExecute(t *testing.T, env map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "RELAY_") || k == "DATABASE_URL" {
			t.Setenv(k, "")
			os.Unsetenv(k)
		}
	}
	for k, v := range env {
		t.Setenv(k, v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out, errOut syncBuffer
	code = Execute(ctx, args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// TestBadInput_HugeTransaction: one transaction of 100,000 rows, to the
// relay binary (the race detector would make the relay itself slow). Every
// event reaches NATS and the webhook, the slot's confirmed_flush_lsn ends
// past the transaction, and events committed after it flow.
func TestBadInput_HugeTransaction(t *testing.T) {
	const rows = 100_000
	s := newSetup(t, pgtest.NewDatabase(t))
	hook := newCountingReceiver(t)
	s.hook = &receiver{Server: hook.Server}
	var logs syncBuffer
	// Info level: a debug line per request would cost more than the request.
	s.startProcess(t, s.biConfigFile(t, biConfig{hookExtra: "    concurrency: 16", logLevel: "info"}), &logs)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("relay log:\n%s", biTail(logs.String(), 8000))
		}
	})
	s.waitSlot(t)

	ctx := context.Background()
	start := time.Now()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'bulk.row', 'bulk', (g % 1000)::text, 'huge-' || g, jsonb_build_object('g', g, 'pad', repeat('x', 100))
		FROM generate_series(1, $1::int) g`, rows); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var afterCommit relay.LSN
	if err := s.pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&afterCommit); err != nil {
		t.Fatal(err)
	}
	committed := time.Since(start)

	js := biJetStreamCount(t, s.nats)
	eventually(t, 150*time.Second, "100,000 events at both sinks", func() bool {
		return hook.distinct("huge-") == rows && js() >= rows
	})
	drained := time.Since(start)
	eventually(t, 30*time.Second, "the slot acknowledged past the transaction", func() bool {
		confirmed, _ := s.slotLSN(t)
		return confirmed >= afterCommit
	})
	if n := js(); n != rows {
		t.Fatalf("the stream holds %d messages, want %d (Nats-Msg-Id deduplicates repeats)", n, rows)
	}
	s.waitDone(t, "true", rows)

	s.biPublish(t, "order.placed", "order", "after", "huge-after-1", `{}`)
	s.biPublish(t, "order.placed", "bulk", "7", "huge-after-2", `{}`) // an aggregate of the transaction
	eventually(t, 30*time.Second, "the events after the transaction at both sinks", func() bool {
		return hook.distinct("huge-after-") == 2 && js() == rows+2
	})
	t.Logf("100,000-row transaction: committed in %v; at both sinks %v after the insert began (%.0f events/s); "+
		"%d webhook requests for %d events", committed.Round(time.Millisecond), drained.Round(time.Millisecond),
		float64(rows)/(drained-committed).Seconds(), hook.requests(), hook.distinct(""))
}

// countingReceiver is a webhook receiver fast enough for 100,000 requests
// under the race detector: it answers 204 and counts distinct ids.
type countingReceiver struct {
	*httptest.Server
	mu    sync.Mutex
	ids   map[string]bool
	total int
}

func newCountingReceiver(t *testing.T) *countingReceiver {
	r := &countingReceiver{ids: map[string]bool{}}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.Copy(io.Discard, req.Body)
		id := req.Header.Get("Webhook-Id")
		r.mu.Lock()
		r.ids[id] = true
		r.total++
		r.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(r.Close)
	return r
}

// distinct counts the distinct ids received that start with prefix.
func (r *countingReceiver) distinct(prefix string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for id := range r.ids {
		if strings.HasPrefix(id, prefix) {
			n++
		}
	}
	return n
}

func (r *countingReceiver) requests() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.total
}

// biJetStreamCount returns a function that reads how many messages the
// OUTBOX stream holds.
func biJetStreamCount(t *testing.T, srv *natstest.Server) func() int {
	t.Helper()
	nc, err := nats.Connect(srv.URL(), srv.ClientOptions()...)
	if err != nil {
		t.Fatalf("nats: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return func() int {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		stream, err := js.Stream(ctx, "OUTBOX")
		if err != nil {
			return 0
		}
		info, err := stream.Info(ctx)
		if err != nil {
			return 0
		}
		return int(info.State.Msgs)
	}
}

// biRelay is a relay run in this process by biRun.
type biRelay struct {
	logs *syncBuffer
	done chan error // the relay's result, once it has returned
	stop func()     // stops it and waits; the test fails if it returned an error
}

// biRun runs the relay in this process, its log (info and above) kept for
// the assertions and the failure message, until the test ends or stop.
func (s *setup) biRun(t *testing.T, cfgPath string) *biRelay {
	t.Helper()
	cfg, err := config.Load(config.Options{Path: cfgPath, Environ: []string{}})
	if err != nil {
		t.Fatal(err)
	}
	r := &biRelay{logs: &syncBuffer{}, done: make(chan error, 1)}
	log := zerolog.New(r.logs).Level(zerolog.InfoLevel).With().Timestamp().Logger()
	ctx, cancel := context.WithCancel(context.Background())
	go func() { r.done <- runRelay(ctx, cfg, log) }()
	var once sync.Once
	r.stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-r.done:
				r.done <- err
				if err != nil {
					t.Errorf("relay: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Error("relay did not stop within 30s")
			}
		})
	}
	t.Cleanup(func() {
		r.stop()
		if t.Failed() {
			t.Logf("relay log:\n%s", biTail(r.logs.String(), 8000))
			s.biDump(t)
		}
	})
	return r
}

// biDump logs the outbox rows and their ledger states, for a failure
// message.
func (s *setup) biDump(t *testing.T) {
	rows, err := s.pool.Query(context.Background(), `SELECT id, event_key, status, coalesce(attempts, -1), handoff_at IS NOT NULL,
		coalesce(last_error, ''), coalesce((SELECT string_agg(action || ':' || state, ',') FROM integration_idempotency l WHERE l.event_key = o.event_key), '')
		FROM integration_outbox o ORDER BY id LIMIT 50`)
	if err != nil {
		t.Logf("dump the outbox: %v", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var attempts int
		var key, status, lastError, ledger string
		var handoff bool
		if err := rows.Scan(&id, &key, &status, &attempts, &handoff, &lastError, &ledger); err != nil {
			t.Logf("dump the outbox: %v", err)
			return
		}
		t.Logf("row %d %q: %s attempts=%d handoff=%v ledger=%s last_error=%.300q", id, biTail(key, 40), status, attempts, handoff, ledger, lastError)
	}
}

// addr returns the address the relay's HTTP server listens on, from its log
// (http.listen is port 0). It fails the test if the relay has returned.
func (r *biRelay) addr(t *testing.T) string {
	t.Helper()
	re := regexp.MustCompile(`"listen":"([^"]+)"[^\n]*serving /metrics`)
	var addr string
	eventually(t, 10*time.Second, "the relay's HTTP listener", func() bool {
		r.alive(t)
		if m := re.FindStringSubmatch(r.logs.String()); m != nil {
			addr = m[1]
		}
		return addr != ""
	})
	return addr
}

// alive fails the test if the relay has returned.
func (r *biRelay) alive(t *testing.T) {
	t.Helper()
	select {
	case err := <-r.done:
		r.done <- err
		t.Fatalf("the relay returned: %v", err)
	default:
	}
}

// biConfig is what biConfigFile changes in configFileWith's config.
type biConfig struct {
	databaseURL string // default the setup's database
	natsURL     string // default the setup's server
	natsExtra   string // YAML lines added to the NATS sink
	hookURL     string // default the setup's receiver
	hookExtra   string // YAML lines added to the webhook sink
	delivery    string // replaces the delivery section (a flow mapping)
	top         string // top-level YAML added
	logLevel    string // replaces the debug log level
}

// biConfigFile writes a relay config as configFileWith does, changed as c
// says.
func (s *setup) biConfigFile(t *testing.T, c biConfig) string {
	t.Helper()
	path := s.configFileWith(t, c.hookExtra, c.top)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	replace := func(old, new string) {
		if !bytes.Contains(b, []byte(old)) {
			t.Fatalf("no %q in the config:\n%s", old, b)
		}
		b = bytes.Replace(b, []byte(old), []byte(new), 1)
	}
	if c.natsURL != "" || c.natsExtra != "" {
		natsURL := cmp.Or(c.natsURL, s.nats.URL())
		if c.natsExtra != "" {
			natsURL += "\n" + c.natsExtra
		}
		replace("    url: "+s.nats.URL()+"\n", "    url: "+natsURL+"\n")
	}
	if c.databaseURL != "" {
		replace(fmt.Sprintf("database_url: %q\n", s.url), fmt.Sprintf("database_url: %q\n", c.databaseURL))
	}
	if c.hookURL != "" {
		replace("    url: "+s.hook.URL+"\n", "    url: "+c.hookURL+"\n")
	}
	if c.logLevel != "" {
		replace("log: {level: debug,", "log: {level: "+c.logLevel+",")
	}
	if c.delivery != "" {
		replace("delivery:\n  backoff: [1m]\n", "delivery: "+c.delivery+"\n")
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// biSource returns the source section for mode: poll mode polls every
// 200 ms so the claim path's outcomes come fast.
func biSource(mode string) string {
	if mode == "poll" {
		return "source: {mode: poll, poll_interval: 200ms}"
	}
	return "source: {mode: replication}"
}

func biTail(s string, n int) string {
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}

// biReadyz returns /readyz's status and body.
func biReadyz(t *testing.T, addr string) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		t.Fatalf("/readyz: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// biPublish publishes one event with outbox_publish; payload is JSON text.
func (s *setup) biPublish(t *testing.T, typ, aggType, aggID, key, payload string) {
	t.Helper()
	var res string
	if err := s.pool.QueryRow(context.Background(), `SELECT outbox_publish($1, $2, $3, $4, $5::jsonb)`,
		typ, aggType, aggID, key, payload).Scan(&res); err != nil || res != "inserted" {
		t.Fatalf("publish %q: %s %v", key, res, err)
	}
}

// biRow returns the row's status and last_error.
func (s *setup) biRow(t *testing.T, key string) (status, lastError string) {
	t.Helper()
	err := s.pool.QueryRow(context.Background(), `SELECT status, coalesce(last_error, '') FROM integration_outbox WHERE event_key = $1`, key).
		Scan(&status, &lastError)
	if err != nil {
		t.Fatalf("row %q: %v", key, err)
	}
	return status, lastError
}

// biLedger returns the ledger's state per sink for key.
func (s *setup) biLedger(t *testing.T, key string) map[string]string {
	t.Helper()
	rows, err := s.pool.Query(context.Background(), `SELECT action, state FROM integration_idempotency WHERE event_key = $1`, key)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for rows.Next() {
		var action, state string
		if err := rows.Scan(&action, &state); err != nil {
			t.Fatal(err)
		}
		out[action] = state
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// biWaitFailed waits until key's row is dead-lettered with a last_error
// matching reason.
func (s *setup) biWaitFailed(t *testing.T, key string, reason *regexp.Regexp) {
	t.Helper()
	var status, lastError string
	deadline := time.Now().Add(30 * time.Second)
	for {
		status, lastError = s.biRow(t, key)
		if status == "failed" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("row %q is %s (last_error %q), want failed", key, status, lastError)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !reason.MatchString(lastError) {
		t.Fatalf("row %q: last_error %q does not match %q", key, lastError, reason)
	}
	t.Logf("dead letter %q: %s", key, lastError)
}

// biWaitDelivered waits until sink has received key and the ledger records
// it.
func (s *setup) biWaitDelivered(t *testing.T, sink, key string) {
	t.Helper()
	eventually(t, 30*time.Second, fmt.Sprintf("%q at %s", key, sink), func() bool {
		return len(s.biAt(t, sink)[key]) > 0 && s.biLedger(t, key)[sink] == "delivered"
	})
}

// biFlows waits until every key has reached both sinks.
func (s *setup) biFlows(t *testing.T, keys ...string) {
	t.Helper()
	eventually(t, 30*time.Second, fmt.Sprintf("%d events at both sinks", len(keys)), func() bool {
		for _, sink := range []string{"hook", "nats"} {
			got := s.biAt(t, sink)
			for _, k := range keys {
				if len(got[k]) == 0 {
					return false
				}
			}
		}
		return true
	})
}

// biAt returns what sink ("hook" or "nats") has received, by event key.
func (s *setup) biAt(t *testing.T, sink string) map[string][]delivery {
	t.Helper()
	if sink == "hook" {
		return byKey(s.hook.deliveries())
	}
	return byKey(natsMessages(t, s.nats))
}

// jsMessage is one stored JetStream message.
type jsMessage struct {
	Subject string
	Header  nats.Header
	Data    []byte
}

// biJetStream reads the OUTBOX stream with subjects and headers, by the
// event key in the body.
func biJetStream(t *testing.T, srv *natstest.Server) map[string]jsMessage {
	t.Helper()
	out := map[string]jsMessage{}
	found := forEachOutboxMessage(t, srv, func(m jetstream.Msg) {
		out[parseDelivery(m.Data(), "").EventKey] = jsMessage{Subject: m.Subject(), Header: m.Headers(), Data: m.Data()}
	})
	if !found {
		t.Fatalf("stream: the OUTBOX stream does not exist")
	}
	return out
}

func ptr[T any](v T) *T { return &v }

func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return s != ""
}
