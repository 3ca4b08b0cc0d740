// Package celfilter compiles a sink's filter (sinks[].filter) and the
// payload fields of its subject or URL template, written in CEL
// (docs/sinks.md, "Filters" and "Routing by field"), into a relay.Filter.
// CEL is the expression language of Kubernetes and Envoy: typed, without
// loops or side effects, and its evaluation is bounded by a cost limit.
package celfilter

import (
	"errors"
	"fmt"
	"strings"

	"github.com/google/cel-go/cel"
	"github.com/google/cel-go/checker"
	"github.com/google/cel-go/common/types"
	"github.com/google/cel-go/common/types/ref"
	"github.com/google/cel-go/interpreter"

	"github.com/outbox-relay/outbox-relay/relay"
)

// CostLimit bounds the work of one evaluation, in CEL's cost units (about
// one per operation or value visited): an expression that would exceed it
// fails on that event instead of running on.
const CostLimit = 10_000

// MaxExprBytes bounds an expression's length.
const MaxExprBytes = 4096

// The variables an expression may read (docs/sinks.md, "Filters"). A NULL
// column reads as "".
var env = func() *cel.Env {
	e, err := cel.NewEnv(
		cel.Variable("id", cel.IntType),
		cel.Variable("event_key", cel.StringType),
		cel.Variable("event_type", cel.StringType),
		cel.Variable("aggregate_type", cel.StringType),
		cel.Variable("aggregate_id", cel.StringType),
		cel.Variable("payload", cel.DynType),
		cel.CrossTypeNumericComparisons(true),
	)
	if err != nil {
		panic(err)
	}
	return e
}()

// Filter is a compiled filter; it implements relay.Filter and is safe for
// concurrent use.
type Filter struct {
	src  string
	prog cel.Program
}

var _ relay.Filter = (*Filter)(nil)

// Compile compiles expr, which must type-check to bool. Its error gives
// the position of each problem in expr as line:column.
func Compile(expr string) (*Filter, error) {
	prog, err := compile(expr, cel.BoolType)
	if err != nil {
		return nil, err
	}
	return &Filter{src: expr, prog: prog}, nil
}

// String returns the filter's source.
func (f *Filter) String() string { return f.src }

// Match evaluates f on ev.
func (f *Filter) Match(ev *relay.Event) (bool, error) {
	v, err := eval(f.prog, &activation{ev: ev, cached: true})
	if err != nil {
		return false, err
	}
	b, ok := v.Value().(bool)
	if !ok {
		return false, fmt.Errorf("%s gave %s, not a bool", f.src, v.Type().TypeName())
	}
	return b, nil
}

// compile parses and checks expr; want, when not nil, is the type its
// result must have.
func compile(expr string, want *cel.Type) (cel.Program, error) {
	if len(expr) > MaxExprBytes {
		return nil, fmt.Errorf("is %d bytes; an expression holds at most %d", len(expr), MaxExprBytes)
	}
	ast, iss := env.Compile(expr)
	if iss.Err() != nil {
		return nil, errors.New(issues(iss))
	}
	// A dyn result (payload.flag) is checked on each event, by the caller.
	if out := ast.OutputType(); want != nil && !out.IsExactType(want) && !out.IsExactType(cel.DynType) {
		return nil, fmt.Errorf("gives %s; it must give %s", out, want)
	}
	// An expression whose cost is bounded by its shape (no comprehension,
	// no string or list function over a value of unknown size) cannot
	// exceed CostLimit, and runs without tracking its cost, which would
	// triple the time of a small one; any other runs under the limit.
	opts := []cel.ProgramOption{cel.EvalOptions(cel.OptOptimize)}
	if est, err := env.EstimateCost(ast, unknownSizes{}); err != nil || est.Max > CostLimit {
		opts = append(opts, cel.CostLimit(CostLimit))
	}
	return env.Program(ast, opts...)
}

// unknownSizes is the cost estimator of EstimateCost: it knows no size
// (the payload's strings and lists have any), so the estimate's Max is
// bounded only for an expression whose cost its shape bounds.
type unknownSizes struct{}

func (unknownSizes) EstimateSize(checker.AstNode) *checker.SizeEstimate { return nil }

func (unknownSizes) EstimateCallCost(string, string, *checker.AstNode, []checker.AstNode) *checker.CallEstimate {
	return nil
}

// issues renders iss as "line L, column C: message", one per problem,
// without cel-go's source excerpt.
func issues(iss *cel.Issues) string {
	var parts []string
	for _, e := range iss.Errors() {
		loc := e.Location
		parts = append(parts, fmt.Sprintf("line %d, column %d: %s", loc.Line(), loc.Column()+1, e.Message))
	}
	return strings.Join(parts, "; ")
}

// eval runs prog on a.
func eval(prog cel.Program, a *activation) (ref.Val, error) {
	v, _, err := prog.Eval(a)
	if err != nil {
		return nil, err
	}
	if types.IsError(v) {
		return nil, v.(*types.Err)
	}
	return v, nil
}

// activation resolves the variables from an event, decoding its payload
// only when the expression reads it: once per event while it is routed
// (cached: relay.Event.PayloadValue), on each call otherwise (a sink's
// subject or URL, rendered beside other sinks on the same event).
type activation struct {
	ev     *relay.Event
	cached bool
}

var _ interpreter.Activation = (*activation)(nil)

func (a *activation) ResolveName(name string) (any, bool) {
	ev := a.ev
	switch name {
	case "id":
		return ev.ID, true
	case "event_key":
		return ev.EventKey, true
	case "event_type":
		return orEmpty(ev.EventType), true
	case "aggregate_type":
		return orEmpty(ev.AggregateType), true
	case "aggregate_id":
		return orEmpty(ev.AggregateID), true
	case "payload":
		var v any
		var err error
		if a.cached {
			v, err = ev.PayloadValue()
		} else {
			v, err = relay.DecodePayload(ev.Payload)
		}
		if err != nil {
			return types.NewErr("%v", err), true
		}
		if v == nil {
			return types.NullValue, true
		}
		return v, true
	}
	return nil, false
}

func (a *activation) Parent() interpreter.Activation { return nil }

func orEmpty(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
