package relay

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"strings"
	"sync"
)

// ErrWorkerStopped is the failure of a long-lived worker that returned while
// its owner still ran.
var ErrWorkerStopped = errors.New("stopped while its owner still ran")

// Group runs the long-lived workers of one owner: the one start/stop
// contract of the relay's goroutines (docs/architecture.md, "Goroutines
// and their owners"). Every goroutine of the relay starts through a Group;
// none is started bare.
//
// The owner starts each worker with Go; a worker runs until the group's
// context ends and then returns, having ended every goroutine of its own.
// A worker that returns before that — with an error, with nil, or by
// panicking — has failed: the group's context is cancelled, so its
// siblings stop, and Stop and Wait return the failure, naming the worker.
// An errgroup whose workers all return nil is only a WaitGroup: a worker
// that died early would go unnoticed while the owner waited on its
// context. Work that is meant to finish on its own — a pass at start, a
// read whose answer the owner waits for — is started with GoTask.
//
// Stop is the owner's one call on the way out: it cancels the group's
// context and waits until every worker has returned. An owner whose stop
// has an order (the phase: its sources stop taking events, the engine
// drains, then the sources are waited for) calls Cancel, does what comes
// between, then Wait.
//
// The owners are blocking functions (Run(ctx) error) and components that
// live from New to Close; each holds its Group, so a Group needs no
// Start: Go starts a worker at once, and there is nothing to wait for
// before it runs.
type Group struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu  sync.Mutex
	err error
}

// NewGroup returns a group whose workers run until ctx ends or the group
// is stopped, and the context they run with: it ends too when a worker
// fails.
func NewGroup(ctx context.Context) (*Group, context.Context) {
	gctx, cancel := context.WithCancel(ctx)
	return &Group{ctx: gctx, cancel: cancel}, gctx
}

// Go starts a long-lived worker named name. It must not be called once
// Stop or Wait has been called.
func (g *Group) Go(name string, run func(ctx context.Context) error) {
	g.start(name, run, false)
}

// GoTask starts work that may finish on its own: returning nil early is not
// a failure; an error or a panic is.
func (g *Group) GoTask(name string, run func(ctx context.Context) error) {
	g.start(name, run, true)
}

func (g *Group) start(name string, run func(ctx context.Context) error, task bool) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		err := func() (err error) {
			defer func() {
				if p := recover(); p != nil {
					err = fmt.Errorf("%s panicked: %v\n%s", name, p, debug.Stack())
				}
			}()
			return run(g.ctx)
		}()
		ended := g.ctx.Err() != nil
		switch {
		case err == nil && (task || ended):
			return
		case err != nil && ended && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)):
			return
		case err == nil:
			err = fmt.Errorf("%s %w", name, ErrWorkerStopped)
		case !strings.HasPrefix(err.Error(), name+":"):
			// A worker's error that names the worker already (a source's
			// "claim path: …") is not named twice.
			err = fmt.Errorf("%s: %w", name, err)
		}
		g.fail(err)
	}()
}

func (g *Group) fail(err error) {
	g.mu.Lock()
	if g.err == nil {
		g.err = err
	}
	g.mu.Unlock()
	g.cancel()
}

// Cancel cancels the group's context: every worker is to return. It does
// not wait for them (Wait does). Safe to call more than once, and
// concurrently with Wait.
func (g *Group) Cancel() { g.cancel() }

// Wait waits until every worker has returned and returns the first
// failure, or nil. It does not cancel the group: it returns once the
// group's context has ended (Cancel, a failure, or the parent's end) and
// the workers have returned.
func (g *Group) Wait() error {
	g.wg.Wait()
	g.cancel()
	return g.Failed()
}

// Stop cancels the group's context and waits until every worker has
// returned: nothing the group started runs after it. It returns the first
// failure, or nil. Safe to call more than once (each call returns the same
// failure), before any worker was started, and concurrently with Wait.
func (g *Group) Stop() error {
	g.cancel()
	return g.Wait()
}

// Failed returns the first failure so far, or nil, without waiting.
func (g *Group) Failed() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.err
}

// Detached returns a context that keeps ctx's values but not its
// cancellation, for work that must outlive ctx: the drain after a phase's
// end, a write that puts claimed rows back, the owner lock held until the
// claim path's rows are settled. It is the only way the relay detaches a
// context (context.WithoutCancel appears nowhere else), so each use is
// found here and says why: why states, at the call, what must run past
// ctx's end and what bounds it instead (a timeout, or a Group's Stop). It
// is not used at run time.
func Detached(ctx context.Context, why string) context.Context {
	return context.WithoutCancel(ctx)
}
