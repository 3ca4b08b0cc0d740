package notify_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/relay/notify"
)

// memStore is a notify.Store in memory: the rows in mark order and a mark
// per channel. A claim succeeds while the mark is the caller's and
// claimable is true.
type memStore struct {
	mu        sync.Mutex
	rows      []notify.DeadLetter
	marks     map[string]notify.Mark
	claimable bool
	claims    int
	recorded  []notify.Mark
	passed    map[string]notify.Mark
}

func newMemStore() *memStore {
	return &memStore{marks: map[string]notify.Mark{}, claimable: true, passed: map[string]notify.Mark{}}
}

// add appends dead letters with the next ids, settled now, naming lastError.
func (m *memStore) add(n int, status, lastError string) []int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	var ids []int64
	for range n {
		id := int64(len(m.rows) + 1)
		m.rows = append(m.rows, notify.DeadLetter{Mark: notify.Mark{At: time.Unix(1_800_000_000, 0).Add(time.Duration(id) * time.Millisecond), ID: id},
			EventKey: "k" + string(rune('a'+id%26)), Status: status, LastError: lastError})
		ids = append(ids, id)
	}
	return ids
}

func (m *memStore) Marks(_ context.Context, channels []string) (map[string]notify.Mark, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]notify.Mark{}
	for _, ch := range channels {
		if _, ok := m.marks[ch]; !ok {
			m.marks[ch] = notify.Mark{} // before every row
		}
		out[ch] = m.marks[ch]
	}
	return out, nil
}

func (m *memStore) Read(_ context.Context, from notify.Mark, limit int, each func(notify.DeadLetter)) (int, error) {
	m.mu.Lock()
	rows := slices.Clone(m.rows)
	m.mu.Unlock()
	n := 0
	for _, r := range rows {
		if from.Before(r.Mark) && n < limit {
			each(r)
			n++
		}
	}
	return n, nil
}

func (m *memStore) Claim(_ context.Context, ch string, from notify.Mark, _ time.Duration) (notify.Claim, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.claimable || m.marks[ch] != from {
		return notify.Claim{}, false, nil
	}
	m.claims++
	return notify.Claim{Channel: ch, At: time.Now()}, true, nil
}

func (m *memStore) Record(_ context.Context, c notify.Claim, to notify.Mark) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.marks[c.Channel] = to
	m.recorded = append(m.recorded, to)
	return true, nil
}

func (m *memStore) Pass(_ context.Context, channels []string, to notify.Mark) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, ch := range channels {
		if m.marks[ch].Before(to) {
			m.marks[ch] = to
			m.passed[ch] = to
		}
	}
	return nil
}

// memSender records the summaries it is sent and answers with fail's
// error (nil: accepted).
type memSender struct {
	mu   sync.Mutex
	sent []notify.Summary
	fail error
}

var errDown = errors.New("receiver down")

func (s *memSender) Send(_ context.Context, sum notify.Summary) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sent = append(s.sent, sum)
	return s.fail
}

func (s *memSender) setFail(err error) {
	s.mu.Lock()
	s.fail = err
	s.mu.Unlock()
}

// bySink returns the summaries sent for sink.
func (s *memSender) bySink(sink string) []notify.Summary {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []notify.Summary
	for _, sum := range s.sent {
		if sum.Sink == sink {
			out = append(out, sum)
		}
	}
	return out
}
