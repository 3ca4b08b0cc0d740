package console

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The live feed's bounds: at most maxFeeds open at once, each with a
// buffer of feedBuffer outcomes (what does not fit is dropped and
// counted), a keep-alive every feedKeepAlive, and a write that waits at
// most feedWriteTimeout for the client.
const (
	maxFeeds         = 8
	feedBuffer       = 1024
	feedKeepAlive    = 15 * time.Second
	feedWriteTimeout = 10 * time.Second
	// feedBatch is how many outcomes go out before a flush.
	feedBatch = 200
)

// handleFeed serves GET /api/v1/feed: server-sent events, one "delivery"
// event per (event, sink) outcome as the relay's lanes record it
// (relay.Feed: key, type, sink, outcome, latency; a payload excerpt only
// with http.feed_payloads), and a "dropped" event with the count of
// outcomes that did not fit in this client's buffer whenever it grows. It
// reads the relay's memory, never the database.
func (s *Server) handleFeed(w http.ResponseWriter, r *http.Request) error {
	if s.cfg.Feed == nil {
		return errorf(http.StatusServiceUnavailable, "the live feed is not running")
	}
	if s.feeds.Add(1) > maxFeeds {
		s.feeds.Add(-1)
		return errorf(http.StatusServiceUnavailable, "%d live feeds are open already; close one (another console tab?)", maxFeeds)
	}
	defer s.feeds.Add(-1)
	sub := s.cfg.Feed.Subscribe(feedBuffer)
	defer sub.Close()

	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("X-Accel-Buffering", "no") // a proxy in front must not hold events back
	w.WriteHeader(http.StatusOK)
	write := func(format string, args ...any) error {
		rc.SetWriteDeadline(time.Now().Add(feedWriteTimeout))
		_, err := fmt.Fprintf(w, format, args...)
		return err
	}
	hello, _ := json.Marshal(map[string]any{"payloads": s.cfg.Feed.Payloads()})
	if err := write("retry: 2000\nevent: hello\ndata: %s\n\n", hello); err != nil {
		return nil
	}
	if rc.Flush() != nil {
		return nil
	}
	keepAlive := time.NewTicker(feedKeepAlive)
	defer keepAlive.Stop()
	var dropped uint64
	for {
		select {
		case <-r.Context().Done():
			return nil
		case <-s.cfg.Done:
			return nil
		case <-keepAlive.C:
			if write(": keep-alive\n\n") != nil || rc.Flush() != nil {
				return nil
			}
		case item := <-sub.C:
			if err := writeItems(write, item, sub); err != nil {
				return nil
			}
			if n := sub.Dropped(); n != dropped {
				dropped = n
				if write("event: dropped\ndata: {\"dropped\":%d}\n\n", n) != nil {
					return nil
				}
			}
			if rc.Flush() != nil {
				return nil
			}
		}
	}
}

// writeItems writes item and the outcomes already waiting, up to
// feedBatch.
func writeItems(write func(string, ...any) error, item relay.FeedItem, sub *relay.FeedSubscription) error {
	for n := 0; ; n++ {
		data, err := json.Marshal(item)
		if err != nil {
			return err
		}
		if err := write("event: delivery\ndata: %s\n\n", data); err != nil {
			return err
		}
		if n == feedBatch {
			return nil
		}
		select {
		case item = <-sub.C:
		default:
			return nil
		}
	}
}
