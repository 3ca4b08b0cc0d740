package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// verifyAnswer is what `outbox-relay verify --json` prints, as far as the
// check reads it (docs/operations.md, "verify").
type verifyAnswer struct {
	Clean bool  `json:"clean"`
	Rows  int64 `json:"rows"`
	Sinks []struct {
		Sink      string `json:"sink"`
		Routed    int64  `json:"routed"`
		Delivered int64  `json:"delivered"`
		Stream    *struct {
			Read    int64 `json:"read"`
			Repeats int64 `json:"repeats"`
		} `json:"stream"`
	} `json:"sinks"`
	Gaps []struct {
		Kind  string `json:"kind"`
		Sink  string `json:"sink"`
		Count int64  `json:"count"`
		First []struct {
			ID       int64  `json:"id"`
			EventKey string `json:"event_key"`
			Detail   string `json:"detail"`
		} `json:"first"`
	} `json:"gaps"`
}

// verifyInvariant runs the relay's own proof over the run, `outbox-relay
// verify --deep` from the run's start, on the database and the stream
// directly (not through the relays' proxies), once the relays have stopped.
// It lists every gap, so that those of the rows handover-delete deleted
// (deleted) can be told from the others.
func (s *stack) verifyInvariant(ctx context.Context, deleted map[string]bool) invariant {
	cfg, err := s.writeConfig("verify", s.dbURL, s.nats.URL())
	if err != nil {
		return checkVerify(nil, -1, "write its configuration: "+err.Error(), nil)
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.o.relayBin, "verify", "--config", cfg, "--deep", "--json", "--list", "0",
		"--since", s.base.Add(-time.Minute).UTC().Format(time.RFC3339Nano))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	code := 0
	if err := cmd.Run(); err != nil {
		var exit *exec.ExitError
		if !errors.As(err, &exit) {
			return checkVerify(nil, -1, err.Error(), nil)
		}
		code = exit.ExitCode()
	}
	return checkVerify(stdout.Bytes(), code, stderr.String(), deleted)
}

// checkVerify judges verify's answer: it ran (exit 0 or 1, JSON on
// stdout) and found no gap — nothing missing, stuck, unrouted or orphaned,
// every delivered event in the stream under one id, nothing in the stream
// the ledger does not know — but those of the rows deleted: a ledger row
// or a message of a row the application deleted is what verify reports as
// orphaned or unrecorded (docs/operations.md, "verify"), rightly.
func checkVerify(out []byte, code int, stderr string, deleted map[string]bool) invariant {
	const name = "outbox-relay verify --deep finds no gap"
	var v violations
	var a verifyAnswer
	if code != 0 && code != 1 {
		v.add("verify did not run: exit %d: %s", code, strings.TrimSpace(stderr))
		return invariant{Name: name, Checked: "nothing: verify did not run", Violations: v.result()}
	}
	if err := json.Unmarshal(out, &a); err != nil {
		v.add("verify's output is not its JSON (exit %d): %v: %.200s %s", code, err, out, strings.TrimSpace(stderr))
		return invariant{Name: name, Checked: "nothing: verify's output did not parse", Violations: v.result()}
	}
	excused := 0
	for _, g := range a.Gaps {
		where := ""
		if g.Sink != "" {
			where = " at " + g.Sink
		}
		for _, x := range g.First {
			if deleted[x.EventKey] && (g.Kind == "orphaned" || g.Kind == "unrecorded") {
				excused++
				continue
			}
			v.add("%s%s: row %d (%s): %s", g.Kind, where, x.ID, x.EventKey, x.Detail)
		}
		if more := g.Count - int64(len(g.First)); more > 0 {
			v.add("%s%s: %d more", g.Kind, where, more)
		}
	}
	if code == 1 && len(a.Gaps) == 0 {
		v.add("verify exited 1 without a gap: %s", strings.TrimSpace(stderr))
	}
	if code == 0 && !a.Clean {
		v.add("verify exited 0 but says it is not clean")
	}
	checked := []string{fmt.Sprintf("%d rows", a.Rows)}
	if excused > 0 {
		checked = append(checked, fmt.Sprintf("%d gaps of rows handover-delete deleted (orphaned, unrecorded)", excused))
	}
	for _, s := range a.Sinks {
		c := fmt.Sprintf("%s %d/%d delivered", s.Sink, s.Delivered, s.Routed)
		if s.Stream != nil {
			c += fmt.Sprintf(" (stream: %d copies read, %d repeats under the same id)", s.Stream.Read, s.Stream.Repeats)
		}
		checked = append(checked, c)
	}
	return invariant{Name: name, Checked: strings.Join(checked, "; "), Violations: v.result()}
}
