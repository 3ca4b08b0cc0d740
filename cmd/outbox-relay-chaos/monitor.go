package main

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// walSample is one second's reading of the WAL.
type walSample struct {
	at        time.Duration
	current   int64 // pg_current_wal_lsn() in bytes
	retained  int64 // current − the slot's restart_lsn; -1 while the slot does not exist
	unacked   int64 // current − the slot's confirmed_flush_lsn; -1 likewise
	walDirSum int64 // size of pg_wal
}

// walMonitor samples the WAL every second and keeps the maxima.
type walMonitor struct {
	s    *stack
	file *os.File // every sample, as CSV, in the work directory

	mu            sync.Mutex
	first, last   walSample
	samples, gaps int // gaps: seconds the database could not be read
	maxRetained   walSample
	maxUnacked    walSample
	maxWALDir     walSample
	// peakRSS is, per relay, the largest peak resident memory (VmHWM) of
	// its processes sampled, first seen at peakRSSAt.
	peakRSS   map[string]int64
	peakRSSAt map[string]time.Duration
}

const walSampleSQL = `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,
  coalesce((SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1), -1),
  coalesce((SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1), -1),
  (SELECT coalesce(sum(size), 0)::bigint FROM pg_ls_waldir())`

// run samples until ctx ends.
func (m *walMonitor) run(ctx context.Context) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		m.sampleRSS()
		if conn == nil {
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			conn, _ = m.s.sqlConn(cctx)
			cancel()
		}
		if conn == nil {
			m.gap()
			continue
		}
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		w := walSample{at: m.s.since()}
		err := conn.QueryRow(qctx, walSampleSQL, slotName).Scan(&w.current, &w.retained, &w.unacked, &w.walDirSum)
		cancel()
		if err != nil {
			conn.Close(context.Background())
			conn = nil
			m.gap()
			continue
		}
		m.add(w)
	}
}

// sampleRSS reads every running relay's peak resident memory.
func (m *walMonitor) sampleRSS() {
	for _, r := range m.s.relays {
		peak := r.peakRSS()
		m.mu.Lock()
		if m.peakRSS == nil {
			m.peakRSS, m.peakRSSAt = map[string]int64{}, map[string]time.Duration{}
		}
		if peak > m.peakRSS[r.name] {
			m.peakRSS[r.name], m.peakRSSAt[r.name] = peak, m.s.since()
		}
		m.mu.Unlock()
	}
}

// peaks returns a copy of the relays' peak resident memory.
func (m *walMonitor) peaks() map[string]int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string]int64, len(m.peakRSS))
	for k, v := range m.peakRSS {
		out[k] = v
	}
	return out
}

func (m *walMonitor) gap() {
	m.mu.Lock()
	m.gaps++
	m.mu.Unlock()
}

func (m *walMonitor) add(w walSample) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.samples == 0 {
		m.first = w
	}
	m.last = w
	m.samples++
	if w.retained > m.maxRetained.retained {
		m.maxRetained = w
	}
	if w.unacked > m.maxUnacked.unacked {
		m.maxUnacked = w
	}
	if w.walDirSum > m.maxWALDir.walDirSum {
		m.maxWALDir = w
	}
	if m.file != nil {
		fmt.Fprintf(m.file, "%.1f,%d,%d,%d,%d\n", w.at.Seconds(), w.current, w.retained, w.unacked, w.walDirSum)
	}
}

// latest returns the last sample.
func (m *walMonitor) latest() walSample {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.last
}
