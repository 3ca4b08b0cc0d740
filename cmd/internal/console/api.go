package console

import (
	"context"
	"fmt"
	"net/http"
	"path"
	"strconv"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// Pages of dead letters: deadLetterPage rows unless asked, at most
// maxDeadLetterPage.
const (
	deadLetterPage    = 50
	maxDeadLetterPage = 500
)

// deadLettersResponse is GET /api/v1/dead-letters: a page of failed and
// held events, oldest id first, each with its sinks' ledger rows.
type deadLettersResponse struct {
	admin.Page
	// NextAfter, when More, is the after= of the next page.
	NextAfter *int64 `json:"next_after,omitempty"`
}

// handleDeadLetters serves GET /api/v1/dead-letters?status=&sink=&type=
// &since=&after=&limit=: the rows `outbox-relay dlq list` shows, a page at
// a time (admin.ListPage), read through the status index.
func (s *Server) handleDeadLetters(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	for name := range q {
		switch name {
		case "status", "sink", "type", "since", "after", "limit":
		default:
			return errorf(http.StatusBadRequest, "unknown parameter %q (status, sink, type, since, after, limit)", name)
		}
	}
	sel := admin.Selection{Statuses: admin.DeadStatuses, Limit: deadLetterPage, EventType: q.Get("type")}
	switch status := q.Get("status"); status {
	case "":
	case "failed", "held", admin.Discarded:
		sel.Statuses = []string{status}
	default:
		return errorf(http.StatusBadRequest, "status %q: failed, held or discarded (none: failed and held)", status)
	}
	if err := checkGlob("type", sel.EventType); err != nil {
		return err
	}
	if v := q.Get("since"); v != "" {
		t, err := admin.ParseSince(v, time.Now())
		if err != nil {
			return errorf(http.StatusBadRequest, "since %v", err)
		}
		sel.Since = t
	}
	if v := q.Get("after"); v != "" {
		after, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return errorf(http.StatusBadRequest, "after %q: an event id", v)
		}
		sel.After = after
	}
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxDeadLetterPage {
			return errorf(http.StatusBadRequest, "limit %q: from 1 to %d", v, maxDeadLetterPage)
		}
		sel.Limit = n
	}
	return s.serveCached(w, r, func() (any, error) {
		var resp deadLettersResponse
		err := s.withDB(r.Context(), readTimeout, func(ctx context.Context, b *Backend) error {
			if name := q.Get("sink"); name != "" {
				sink, err := b.Tables.Sink(name)
				if err != nil {
					return errorf(http.StatusBadRequest, "sink: %v", err)
				}
				sel.Routes, sel.Filter, sel.NotDeliveredTo = sink.Events, sink.Filter, sink.Name
			}
			page, err := admin.ListPage(ctx, b.DB, b.Tables, sel)
			resp.Page = page
			return err
		})
		if resp.More {
			last := resp.Entries[len(resp.Entries)-1].ID
			resp.NextAfter = &last
		}
		return resp, err
	})
}

// changeRequest is the body of an action: which events.
type changeRequest struct {
	// IDs chooses these events; an empty list chooses none.
	IDs *[]int64 `json:"ids"`
	// Sink narrows to the events routed to this sink; retry and replay
	// then reset only its ledger rows, and retry and discard take only
	// the events not delivered to it.
	Sink string `json:"sink"`
	// EventType is a glob over the event type, as a sink's events.
	EventType string `json:"event_type"`
	// Since keeps events created at or after it: RFC 3339, a date, or a
	// duration ago (24h).
	Since string `json:"since"`
	// All chooses every failed and held event (retry, discard) without a
	// filter.
	All bool `json:"all"`
	// DryRun counts the events the action would take, and changes none.
	DryRun bool `json:"dry_run"`
}

// changeResponse is what an action did.
type changeResponse struct {
	Action string `json:"action"`
	DryRun bool   `json:"dry_run,omitempty"`
	// Selected is how many events matched; Rows how many changed (an
	// event whose status moved on meanwhile is left alone); LedgerRows
	// how many ledger rows were deleted.
	Selected   int    `json:"selected"`
	Rows       int64  `json:"rows"`
	LedgerRows int64  `json:"ledger_rows"`
	Message    string `json:"message"`
}

// handleChange serves an action's POST: the events the body chooses are
// selected as the dlq and replay commands select them (admin.SelectIDs)
// and changed by the same code (admin.Action.Apply). An action that
// matches nothing is an error (422) saying so.
func (s *Server) handleChange(a admin.Action) handlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		var req changeRequest
		if err := decodeBody(r, &req); err != nil {
			return err
		}
		dead := a.Name != admin.ActionReplay.Name
		switch {
		case req.IDs != nil && len(*req.IDs) == 0:
			return errorf(http.StatusBadRequest, "ids: the list is empty; name at least one event id")
		case !dead && req.IDs == nil && req.Since == "":
			return errorf(http.StatusBadRequest, "say what to replay: since (a time, a date or a duration ago) and/or ids; event_type and sink narrow them")
		case !dead && req.All:
			return errorf(http.StatusBadRequest, "all: replay takes since and/or ids")
		case dead && req.IDs == nil && req.Sink == "" && req.EventType == "" && req.Since == "" && !req.All:
			return errorf(http.StatusBadRequest, "say which events to %s: ids, a filter (sink, event_type, since), or all: true for every failed and held event", a.Name)
		}
		sel := admin.Selection{Statuses: a.Statuses, EventType: req.EventType}
		if req.IDs != nil {
			sel.IDs = *req.IDs
		}
		if err := checkGlob("event_type", req.EventType); err != nil {
			return err
		}
		if req.Since != "" {
			t, err := admin.ParseSince(req.Since, time.Now())
			if err != nil {
				return errorf(http.StatusBadRequest, "since %v", err)
			}
			sel.Since = t
		}
		var resp changeResponse
		err := s.withDB(r.Context(), actionTimeout, func(ctx context.Context, b *Backend) error {
			var sinks []string
			if req.Sink != "" {
				sink, err := b.Tables.Sink(req.Sink)
				if err != nil {
					return errorf(http.StatusBadRequest, "sink: %v", err)
				}
				sel.Routes, sel.Filter, sinks = sink.Events, sink.Filter, []string{sink.Name}
				if dead {
					sel.NotDeliveredTo = sink.Name
				}
			}
			ids, err := admin.SelectIDs(ctx, b.DB, b.Tables, sel)
			if err != nil {
				return err
			}
			resp = changeResponse{Action: a.Name, DryRun: req.DryRun, Selected: len(ids)}
			if len(ids) == 0 {
				return errorf(http.StatusUnprocessableEntity, "%s", nothingMatches(ctx, a, b, sel))
			}
			if req.DryRun {
				resp.Message = fmt.Sprintf("%s would be %s", events(len(ids)), a.Done)
				return nil
			}
			changed, err := a.Apply(ctx, b.DB, b.Tables, ids, sinks, nil)
			resp.Rows, resp.LedgerRows = changed.Rows, changed.LedgerRows
			s.cache.forget()
			s.logAction(r, a, req, resp, err)
			if err != nil {
				return err
			}
			resp.Message = fmt.Sprintf("%s %s", a.Done, events(int(changed.Rows)))
			if changed.LedgerRows > 0 {
				resp.Message += fmt.Sprintf(", cleared %d ledger rows", changed.LedgerRows)
			}
			if skipped := len(ids) - int(changed.Rows); skipped > 0 {
				resp.Message += fmt.Sprintf("; %s changed status since they were selected and were left alone", events(skipped))
			}
			return nil
		})
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, resp)
		return nil
	}
}

// nothingMatches says why an action found no event; for a replay, how many
// matching events are on their way (pending or processing) and so left
// alone.
func nothingMatches(ctx context.Context, a admin.Action, b *Backend, sel admin.Selection) string {
	what := "failed or held"
	if a.Name == admin.ActionReplay.Name {
		what = "done, failed or held"
		sel.Statuses = admin.InFlightStatuses
		if inFlight, err := admin.SelectIDs(ctx, b.DB, b.Tables, sel); err == nil && len(inFlight) > 0 {
			which := fmt.Sprintf("%d matching events are", len(inFlight))
			if len(inFlight) == 1 {
				which = "1 matching event is"
			}
			return fmt.Sprintf("nothing to replay: no %s event matches; %s pending or processing: on the way, left alone", what, which)
		}
	}
	return fmt.Sprintf("nothing to %s: no %s event matches", a.Name, what)
}

// logAction logs an action with what it changed and who asked.
func (s *Server) logAction(r *http.Request, a admin.Action, req changeRequest, resp changeResponse, err error) {
	ev := s.log.Info()
	if err != nil {
		ev = s.log.Error().Err(err)
	}
	if req.IDs != nil {
		ids := *req.IDs
		ev = ev.Int("ids", len(ids))
		if len(ids) <= 20 {
			ev = ev.Ints64("id_list", ids)
		}
	}
	ev.Str("action", a.Name).Str("sink", req.Sink).Str("event_type", req.EventType).Str("since", req.Since).Bool("all", req.All).
		Int("selected", resp.Selected).Int64("rows", resp.Rows).Int64("ledger_rows", resp.LedgerRows).
		Str("from", r.RemoteAddr).Str("forwarded_for", r.Header.Get("X-Forwarded-For")).
		Msg("admin API: " + a.Done + " events")
}

// checkGlob refuses a glob path.Match cannot read, naming the parameter.
func checkGlob(param, glob string) error {
	if glob == "" {
		return nil
	}
	if _, err := path.Match(glob, ""); err != nil {
		return errorf(http.StatusBadRequest, "%s %q is not a valid glob (path.Match syntax: *, ?, [a-z])", param, glob)
	}
	return nil
}

// events says "1 event" or "n events".
func events(n int) string {
	if n == 1 {
		return "1 event"
	}
	return fmt.Sprintf("%d events", n)
}
