package ledger

import (
	"context"
	"testing"
)

// TestStreamFromDropsRecordOfOldServer: the delivered ids waiting to be
// written belong to the server they were streamed from: binding the stream
// to another drops them; binding it to the same one again keeps them.
func TestStreamFromDropsRecordOfOldServer(t *testing.T) {
	s := New(nil, DefaultConfig())
	ctx := context.Background()
	if n, err := s.StreamFrom(ctx, "7", 1); err != nil || n != 0 {
		t.Fatalf("first StreamFrom = %d, %v", n, err)
	}
	if _, err := s.record.add([]int64{1, 2, 3}); err != nil {
		t.Fatal(err)
	}
	s.BeginTerm()
	if n, err := s.StreamFrom(ctx, "7", 1); err != nil || n != 0 {
		t.Fatalf("StreamFrom the same server = %d, %v; want 0 dropped", n, err)
	}
	s.BeginTerm()
	if n, err := s.StreamFrom(ctx, "7", 2); err != nil || n != 3 {
		t.Fatalf("StreamFrom the promoted standby = %d, %v; want the 3 ids dropped", n, err)
	}
	if ids := s.record.take(); len(ids) != 0 {
		t.Errorf("record after the change: %v, want empty", ids)
	}
}
