package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// pauseRequest is the optional body of POST /api/v1/sinks/{name}/pause.
type pauseRequest struct {
	// Reason is the operator's note, shown by status and the console.
	Reason string `json:"reason"`
}

// pauseResponse is what a pause or a resume did.
type pauseResponse struct {
	Action string `json:"action"` // pause or resume
	Sink   string `json:"sink"`
	// Changed is false when the sink already was (pause) or was not
	// (resume) paused.
	Changed bool         `json:"changed"`
	Pause   *admin.Pause `json:"pause,omitempty"`
	Message string       `json:"message"`
}

// handlePause serves POST /api/v1/sinks/{name}/pause and /resume
// (docs/operations.md, "Pause and resume a sink"): the same code as
// `outbox-relay sink pause|resume` (admin.PauseSink, ResumeSink). An
// unknown sink is a 404.
func (s *Server) handlePause(pause bool) handlerFunc {
	action := "resume"
	if pause {
		action = "pause"
	}
	return func(w http.ResponseWriter, r *http.Request) error {
		name := r.PathValue("name")
		var req pauseRequest
		if pause && r.ContentLength != 0 {
			if err := decodeBody(r, &req); err != nil {
				return err
			}
		}
		resp := pauseResponse{Action: action, Sink: name}
		err := s.withDB(r.Context(), readTimeout, func(ctx context.Context, b *Backend) error {
			if pause {
				p, already, err := admin.PauseSink(ctx, b.DB, b.Tables, name, req.Reason, "admin API from "+r.RemoteAddr)
				if err != nil {
					return err
				}
				resp.Changed, resp.Pause = !already, &p
				resp.Message = fmt.Sprintf("sink %s paused: its events wait with the claim path until it is resumed", name)
				if already {
					resp.Message = fmt.Sprintf("sink %s was already paused (since %s)", name, p.PausedAt.UTC().Format(time.RFC3339))
				}
				return nil
			}
			since, was, err := admin.ResumeSink(ctx, b.DB, b.Tables, name)
			if err != nil {
				return err
			}
			resp.Changed = was
			resp.Message = fmt.Sprintf("sink %s was not paused", name)
			if was {
				resp.Message = fmt.Sprintf("sink %s resumed after %s paused: the events it held are delivered in per-aggregate order", name, time.Since(since).Round(time.Second))
			}
			return nil
		})
		if errors.Is(err, admin.ErrNoSuchSink) {
			err = errorf(http.StatusNotFound, "%v", err)
		}
		s.cache.forget()
		ev := s.log.Info()
		var ae *apiError
		switch {
		case errors.As(err, &ae):
			ev = s.log.Warn().Err(err)
		case err != nil:
			ev = s.log.Error().Err(err)
		}
		ev.Str("action", action).Str("sink", name).Str("reason", req.Reason).Bool("changed", resp.Changed).
			Str("from", r.RemoteAddr).Str("forwarded_for", r.Header.Get("X-Forwarded-For")).
			Msg("admin API: " + action + " sink")
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, resp)
		return nil
	}
}
