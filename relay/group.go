package relay

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
)

// ErrWorkerStopped is the failure of a long-lived worker that returned while
// its owner still ran.
var ErrWorkerStopped = errors.New("stopped while its owner still ran")

// Group runs the long-lived workers of one owner: the one start/stop
// contract of the relay's goroutines (docs/architecture.md, "goroutines
// and their owners"). The owner starts each worker with Go; a worker runs
// until the group's context ends and then returns, having ended every
// goroutine of its own. A worker that returns before that — with an error,
// with nil, or by panicking — has failed: the group's context is cancelled,
// so its siblings stop, and Wait returns the failure, naming the worker. An
// errgroup whose workers all return nil is only a WaitGroup: a worker that
// died early would go unnoticed while the owner waited on its context.
//
// Stop ends the group from the owner's side (the owner's stop order: it
// stops one group, waits for it, then stops the next). Work that is meant
// to finish on its own — a pass at start — is started with GoTask.
type Group struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu  sync.Mutex
	err error
}

// NewGroup returns a group whose workers run until ctx ends or Stop is
// called, and the context they run with.
func NewGroup(ctx context.Context) (*Group, context.Context) {
	gctx, cancel := context.WithCancel(ctx)
	return &Group{ctx: gctx, cancel: cancel}, gctx
}

// Go starts a long-lived worker named name.
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
		default:
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

// Stop cancels the group's context: every worker is to return. Safe to
// call more than once, and concurrently with Wait.
func (g *Group) Stop() { g.cancel() }

// Wait waits until every worker has returned and returns the first
// failure, or nil.
func (g *Group) Wait() error {
	g.wg.Wait()
	g.cancel()
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.err
}

// Failed returns the first failure so far, or nil, without waiting.
func (g *Group) Failed() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.err
}
