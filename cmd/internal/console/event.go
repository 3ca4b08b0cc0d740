package console

import (
	"context"
	"errors"
	"net/http"
	"strconv"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// handleEvent serves GET /api/v1/events/{key} and GET /api/v1/events?id=N:
// one event as `outbox-relay event` shows it (admin.LookupEvent): its row,
// what the relay makes of it, the earlier event it waits behind, and each
// sink's ledger row. The payload's size, never the payload.
func (s *Server) handleEvent(w http.ResponseWriter, r *http.Request) error {
	var ref admin.EventRef
	key, id := r.PathValue("key"), r.URL.Query().Get("id")
	switch {
	case key != "" && id != "":
		return errorf(http.StatusBadRequest, "name the event by its key (/api/v1/events/{key}) or by its id (?id=N), not both")
	case key != "":
		ref.Key = key
	case id != "":
		n, err := strconv.ParseInt(id, 10, 64)
		if err != nil {
			return errorf(http.StatusBadRequest, "id %q: an event id", id)
		}
		ref.ID = n
	default:
		return errorf(http.StatusBadRequest, "name the event: /api/v1/events/{key}, or /api/v1/events?id=N")
	}
	return s.serveCached(w, r, func() (any, error) {
		var report admin.EventReport
		err := s.withDB(r.Context(), readTimeout, func(ctx context.Context, b *Backend) (err error) {
			report, err = admin.LookupEvent(ctx, b.DB, b.Tables, ref)
			if errors.Is(err, admin.ErrEventNotFound) {
				return errorf(http.StatusNotFound, "%v", err)
			}
			return err
		})
		return report, err
	})
}
