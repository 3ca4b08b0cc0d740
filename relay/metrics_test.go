package relay

import (
	"context"
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// TestDivertReasons: divertReasons, the reasons InitMetrics creates
// handed_off_total series for, are exactly the reasons the engine uses: every
// string literal given to an Outcome's or Decision's Why field in this
// package ("retries" among them). It reads the source, so a rewrite of the
// engine fails it rather than the build.
func TestDivertReasons(t *testing.T) {
	fset := token.NewFileSet()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	used := map[string]bool{}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			kv, ok := n.(*ast.KeyValueExpr)
			if !ok {
				return true
			}
			if id, ok := kv.Key.(*ast.Ident); !ok || id.Name != "Why" {
				return true
			}
			lit, ok := kv.Value.(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true // carried over from another outcome's Why
			}
			v, _ := strconv.Unquote(lit.Value)
			used[v] = true
			return true
		})
	}
	var got []string
	for v := range used {
		got = append(got, v)
	}
	sort.Strings(got)
	want := slices.Clone(divertReasons)
	sort.Strings(want)
	if !slices.Equal(got, want) {
		t.Errorf("the engine diverts with reasons %v; divertReasons (metrics.go) lists %v", got, want)
	}
}

type namedSink string

func (s namedSink) Name() string                               { return string(s) }
func (namedSink) Send(context.Context, *Delivery, func(error)) {}
func (namedSink) Close(context.Context) error                  { return nil }

// series returns c's series as "label=value,..." strings with their
// counter value or histogram count.
func series(t *testing.T, c prometheus.Collector) map[string]float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 256)
	go func() { c.Collect(ch); close(ch) }()
	out := map[string]float64{}
	for m := range ch {
		var d dto.Metric
		if err := m.Write(&d); err != nil {
			t.Fatal(err)
		}
		var labels []string
		for _, l := range d.GetLabel() {
			labels = append(labels, l.GetName()+"="+l.GetValue())
		}
		out[strings.Join(labels, ",")] = d.GetCounter().GetValue() + float64(d.GetHistogram().GetSampleCount()) + d.GetGauge().GetValue()
	}
	return out
}

// TestInitMetrics: InitMetrics creates every labelled series of each sink
// at 0, and keeps the value of one that already counts.
func TestInitMetrics(t *testing.T) {
	failedBefore := series(t, failedTotal)["path=claim,sink=init-b"]
	failedTotal.WithLabelValues("init-b", string(PathClaim)).Inc()
	InitMetrics([]Route{{Sink: namedSink("init-a")}, {Sink: namedSink("init-b")}})
	for _, sink := range []string{"init-a", "init-b"} {
		for name, c := range map[string]*prometheus.CounterVec{"delivered": deliveredTotal, "failed": failedTotal, "retried": retriedTotal, "held": heldTotal} {
			got := series(t, c)
			for _, path := range []string{string(PathClaim), string(PathStream)} {
				key := "path=" + path + ",sink=" + sink
				v, ok := got[key]
				want := 0.0
				if name == "failed" && sink == "init-b" && path == string(PathClaim) {
					want = failedBefore + 1
				}
				if !ok || v != want {
					t.Errorf("%s_total{%s} = %v (exists: %v), want %v", name, key, v, ok, want)
				}
			}
		}
		lat := series(t, deliveryLatency)
		for _, path := range []string{string(PathClaim), string(PathStream)} {
			if _, ok := lat["path="+path+",sink="+sink]; !ok {
				t.Errorf("delivery_latency_seconds{sink=%s,path=%s} missing", sink, path)
			}
		}
		handed := series(t, divertedTotal)
		for _, reason := range divertReasons {
			if _, ok := handed["reason="+reason+",sink="+sink]; !ok {
				t.Errorf("handed_off_total{sink=%s,reason=%s} missing", sink, reason)
			}
		}
	}
	modes := series(t, ModeGauge)
	for _, m := range []string{"mode=poll", "mode=replication"} {
		if _, ok := modes[m]; !ok {
			t.Errorf("mode{%s} missing", m)
		}
	}
}
