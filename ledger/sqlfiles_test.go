package ledger

import (
	"strings"
	"testing"
)

// TestRenderStatements: every embedded statement renders for both
// orderings, and the claim's switches choose what they say: replication
// mode's window reads only the diverted rows, poll mode's every due row,
// the newest window newest first, and ordering: none no aggregate.
func TestRenderStatements(t *testing.T) {
	tb := tables{outbox: `"s"."o"`, ledger: `"s"."l"`, checkpoint: `"s"."c"`}
	for _, unordered := range []bool{false, true} {
		st := render(tb, claimOptions{unordered: unordered})
		diverted, poll, newest := st.claim.claim[0], st.claim.claim[1], st.claim.newest
		const onlyDiverted = "AND o.handoff_at IS NOT NULL\n       AND (o.available_at, o.id) >"
		if !strings.Contains(diverted, onlyDiverted) || !strings.Contains(newest, onlyDiverted) || strings.Contains(poll, onlyDiverted) {
			t.Errorf("unordered %v: only the replication-mode windows read diverted rows alone", unordered)
		}
		if !strings.Contains(newest, "ORDER BY o.available_at DESC, o.id DESC") || strings.Contains(diverted, "DESC, o.id DESC\n") {
			t.Errorf("unordered %v: only the newest window reads newest first", unordered)
		}
		if got := strings.Contains(diverted, "NULL::text AS at"); got != unordered {
			t.Errorf("unordered %v: window without aggregates = %v", unordered, got)
		}
		for name, q := range map[string]string{"diverted": diverted, "poll": poll, "newest": newest, "handOverRead": st.handOverRead} {
			if strings.Contains(q, "{{") || !strings.Contains(q, `"s"."o"`) {
				t.Errorf("%s: not rendered with the outbox: %s", name, q)
			}
		}
	}
	if catalog.Get("OwnerLockHolder") == "" {
		t.Error("no catalog statements")
	}
}
