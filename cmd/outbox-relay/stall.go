package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/supervisor"
)

// The stall detector (docs/operations-health.md, "Health that sees a
// stall"). A relay that runs but no longer moves — a sink request that
// never returns while the stream may not hand its event off, settlement or
// checkpoint writes that block, a deadlock of our own — looks alive to
// every other check. The detector watches the two paths of the current
// leadership term:
//
//   - the stream waits when it has read data it has not acknowledged to the
//     slot (replication.Source.Progress: received ahead of acknowledged) or
//     holds events the engine has not settled; it progresses when the
//     acknowledged position moves;
//   - the claim path waits when the engine holds claimed events it has not
//     settled; it progresses when the engine settles one of them.
//
// A path that has waited without progress for http.stall_after is stalled:
// /healthz and /readyz answer 503 saying which and why, outbox_relay_stalled
// is 1, and an orchestrator restarts the relay. A path with nothing waiting
// is never stalled, however long it has been idle. Rows a claim path cannot
// even claim (the database down, the table locked) are not the relay's
// stall — a restart would not help — and outbox_relay_oldest_pending_age
// raises them.

// streamProgress is the replication source's side (replication.Source).
type streamProgress interface {
	Progress() (received, acknowledged relay.LSN)
}

// engineProgress is the engine's side (relay.Engine).
type engineProgress interface {
	Progress(p relay.Path) (unsettled int, settled uint64)
}

// stallWatch is the stall detector of one relay process.
type stallWatch struct {
	after  time.Duration // 0: never stalled, progress still tracked
	health *health
	log    zerolog.Logger
	now    func() time.Time

	mu     sync.Mutex
	engine engineProgress // the current term's; nil between terms
	stream streamProgress // the current term's source while it streams
	paths  map[relay.Path]*pathProgress
	reason string // why the relay is stalled; "" when it is not
}

// pathProgress is what the detector remembers of one path.
type pathProgress struct {
	marker  uint64    // the acknowledged position (stream) or settled count (claim)
	since   time.Time // when it was first seen waiting since it last moved
	waiting bool      // it was waiting at the last check of the current term
}

func newStallWatch(after time.Duration, h *health, log zerolog.Logger) *stallWatch {
	return &stallWatch{after: after, health: h, log: log, now: time.Now, paths: map[relay.Path]*pathProgress{
		relay.PathStream: {}, relay.PathClaim: {},
	}}
}

// watch returns cfg with its Terms and Observer wrapped so that the
// detector follows the terms: each term's engine and stream source are
// watched from their start; a term's end, or a fall-back to polling,
// forgets them.
func (w *stallWatch) watch(cfg supervisor.Config) supervisor.Config {
	if cfg.Observer == nil {
		cfg.Observer = supervisor.NopObserver{}
	}
	cfg.Terms = watchedTerms{Terms: cfg.Terms, w: w}
	cfg.Observer = watchedObserver{Observer: cfg.Observer, w: w}
	return cfg
}

// watchedTerms watches each engine and stream source its Terms builds.
type watchedTerms struct {
	supervisor.Terms
	w *stallWatch
}

func (t watchedTerms) Engine() (*relay.Engine, error) {
	e, err := t.Terms.Engine()
	if err == nil {
		t.w.set(e, nil)
	}
	return e, err
}

func (t watchedTerms) Stream(e *relay.Engine) (supervisor.Runner, error) {
	src, err := t.Terms.Stream(e)
	if p, ok := src.(streamProgress); ok && err == nil {
		t.w.set(e, p)
	}
	return src, err
}

// watchedObserver forgets the stream when a phase polls, and the term when
// leadership ends.
type watchedObserver struct {
	supervisor.Observer
	w *stallWatch
}

func (o watchedObserver) Mode(mode string) {
	o.Observer.Mode(mode)
	if mode == "poll" {
		o.w.mu.Lock()
		o.w.stream = nil
		o.w.mu.Unlock()
	}
}

func (o watchedObserver) Leading(leader bool) {
	o.Observer.Leading(leader)
	if !leader {
		o.w.set(nil, nil)
	}
}

// set watches engine e and stream source s (either may be nil), starting
// afresh when either changed.
func (w *stallWatch) set(e engineProgress, s streamProgress) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if e != w.engine || s != w.stream {
		for _, p := range w.paths {
			*p = pathProgress{}
		}
	}
	w.engine, w.stream = e, s
}

// run checks every second (more often for a short stall_after) until ctx
// ends.
func (w *stallWatch) run(ctx context.Context) {
	every := time.Second
	if w.after > 0 {
		every = min(every, max(w.after/10, 10*time.Millisecond))
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		w.check()
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// check reads both paths' progress once and updates the health, the
// metrics and the log.
func (w *stallWatch) check() {
	w.mu.Lock()
	now := w.now()
	var reasons []string
	oldest := now
	observe := func(path relay.Path, waiting bool, marker uint64, describe func(time.Duration) string) {
		p := w.paths[path]
		if !waiting || !p.waiting || marker != p.marker {
			p.since = now
		}
		p.marker, p.waiting = marker, waiting
		if !waiting {
			return
		}
		if p.since.Before(oldest) {
			oldest = p.since
		}
		if d := now.Sub(p.since); w.after > 0 && d >= w.after {
			reasons = append(reasons, describe(d))
		}
	}
	if w.stream != nil {
		received, acked := w.stream.Progress()
		unsettled := 0
		if w.engine != nil {
			unsettled, _ = w.engine.Progress(relay.PathStream)
		}
		observe(relay.PathStream, received > acked || unsettled > 0, uint64(acked), func(d time.Duration) string {
			return fmt.Sprintf("the stream has acknowledged nothing new for %s (acknowledged %s, read up to %s, %d events unsettled)",
				d.Round(time.Second), acked, received, unsettled)
		})
	} else {
		observe(relay.PathStream, false, 0, nil)
	}
	if w.engine != nil {
		unsettled, settled := w.engine.Progress(relay.PathClaim)
		observe(relay.PathClaim, unsettled > 0, settled, func(d time.Duration) string {
			return fmt.Sprintf("the claim path has settled nothing for %s (%d events in flight)", d.Round(time.Second), unsettled)
		})
	} else {
		observe(relay.PathClaim, false, 0, nil)
	}
	reason := ""
	for i, r := range reasons {
		if i > 0 {
			reason += "; "
		}
		reason += r
	}
	was := w.reason
	w.reason = reason
	w.mu.Unlock()

	relay.LastProgress.Set(float64(oldest.UnixNano()) / 1e9)
	w.health.setStalled(reason)
	switch {
	case reason != "" && was == "":
		relay.Stalled.Set(1)
		w.log.Error().Str("reason", reason).Dur("stall_after", w.after).
			Msg("stalled: events wait and nothing progresses; /healthz fails so that the relay is restarted")
	case reason == "" && was != "":
		relay.Stalled.Set(0)
		w.log.Info().Msg("progressing again: /healthz passes")
	}
}
