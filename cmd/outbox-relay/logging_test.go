package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

var (
	// jsonTime is the "time" of a JSON line: UTC, milliseconds.
	jsonTime = regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.(\d{3})Z$`)
	// consoleTime starts a console line.
	consoleTime = regexp.MustCompile(`^\d\d:\d\d:\d\d\.(\d{3}) `)
)

// TestLogFormat_JSON: the time carries the milliseconds the line was written
// at, durations are Go's duration text, and nothing is colored.
func TestLogFormat_JSON(t *testing.T) {
	var buf bytes.Buffer
	log := newLogger(&buf, config.LogConfig{Level: "info", Format: "auto"}) // not a terminal: JSON
	writeSampleLines(log)
	millis := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		fields := mustLogLine(t, line)
		at, _ := fields["time"].(string)
		m := jsonTime.FindStringSubmatch(at)
		if m == nil {
			t.Fatalf("time %q is not RFC 3339 UTC with milliseconds: %s", at, line)
		}
		millis[m[1]] = true
		written, err := time.Parse(jsonTimeFormat, at)
		if err != nil || time.Since(written) > time.Minute || time.Since(written) < 0 {
			t.Errorf("time %q is not when the line was written (%v)", at, err)
		}
		if fields["message"] == "durations" && (fields["retry_in"] != "1.5s" || fields["interval"] != "1m0s" || fields["duplicate_window"] != "2m0s") {
			t.Errorf("durations are not duration text: %s", line)
		}
	}
	if len(millis) < 2 {
		t.Errorf("every line's time has the same milliseconds %v: the time is cut to the second", millis)
	}
}

// TestLogFormat_Console: the console's time column shows the line's
// milliseconds, durations read as in JSON, and a writer that is not a
// terminal gets no escape codes.
func TestLogFormat_Console(t *testing.T) {
	var buf bytes.Buffer
	log := newLogger(&buf, config.LogConfig{Level: "info", Format: "console"})
	writeSampleLines(log)
	out := buf.String()
	if strings.Contains(out, "\x1b[") {
		t.Errorf("console output to a non-terminal carries escape codes:\n%q", out)
	}
	millis := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		m := consoleTime.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("line does not start with HH:MM:SS.mmm: %q", line)
		}
		millis[m[1]] = true
		if strings.Contains(line, "durations") {
			for _, want := range []string{"retry_in=1.5s", "interval=1m0s", "duplicate_window=2m0s"} {
				if !strings.Contains(line, want) {
					t.Errorf("console line lacks %s: %q", want, line)
				}
			}
		}
	}
	if len(millis) < 2 {
		t.Errorf("every line's time has the same milliseconds %v: the time is cut to the second", millis)
	}
}

// writeSampleLines logs a line with durations, then ten lines 7 ms apart:
// their times cannot all fall on the same millisecond.
func writeSampleLines(log zerolog.Logger) {
	log.Info().Dur("retry_in", 1500*time.Millisecond).Dur("interval", time.Minute).Dur("duplicate_window", 2*time.Minute).Msg("durations")
	for i := range 10 {
		time.Sleep(7 * time.Millisecond)
		log.Info().Int("i", i).Msg("tick")
	}
}

// mustLogLine parses one JSON log line, failing t on a line that is not a
// JSON object or that repeats a key: pipelines that reject duplicate fields
// drop such lines.
func mustLogLine(t testing.TB, line string) map[string]any {
	t.Helper()
	if err := checkDuplicateKeys([]byte(line)); err != nil {
		t.Errorf("log line %s: %v", line, err)
	}
	var fields map[string]any
	dec := json.NewDecoder(strings.NewReader(line))
	dec.UseNumber()
	if err := dec.Decode(&fields); err != nil {
		t.Fatalf("log line is not a JSON object: %v: %s", err, line)
	}
	return fields
}

// checkDuplicateKeys returns an error naming the first key an object in the
// JSON text data repeats.
func checkDuplicateKeys(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var walk func() error
	walk = func() error {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		switch tok {
		case json.Delim('{'):
			seen := map[string]bool{}
			for dec.More() {
				k, err := dec.Token()
				if err != nil {
					return err
				}
				key := k.(string)
				if seen[key] {
					return fmt.Errorf("duplicate key %q", key)
				}
				seen[key] = true
				if err := walk(); err != nil {
					return err
				}
			}
			_, err = dec.Token() // '}'
			return err
		case json.Delim('['):
			for dec.More() {
				if err := walk(); err != nil {
					return err
				}
			}
			_, err = dec.Token() // ']'
			return err
		}
		return nil
	}
	return walk()
}

func TestCheckDuplicateKeys(t *testing.T) {
	for doc, dup := range map[string]bool{
		`{"sink":"nats","level":"info"}`:                  false,
		`{"sink":"nats","sink":"nats"}`:                   true,
		`{"a":{"b":1,"b":2}}`:                             true,
		`{"a":[{"b":1},{"b":2}],"c":"{\"c\":1,\"c\":2}"}`: false,
	} {
		if err := checkDuplicateKeys([]byte(doc)); (err != nil) != dup {
			t.Errorf("%s: %v", doc, err)
		}
	}
}

// logLines is a JSON log written by a relay, checked line by line as it is
// written: every line must parse and carry each key once.
type logLines struct {
	t  testing.TB
	mu sync.Mutex
	// lines holds the lines written so far.
	lines []string
	// forward receives every line too (the test's log), if not nil.
	forward io.Writer
	partial []byte
}

func newLogLines(t testing.TB, forward io.Writer) *logLines {
	return &logLines{t: t, forward: forward}
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.forward != nil {
		l.forward.Write(p)
	}
	l.partial = append(l.partial, p...)
	for {
		i := bytes.IndexByte(l.partial, '\n')
		if i < 0 {
			break
		}
		line := string(l.partial[:i])
		l.partial = l.partial[i+1:]
		if strings.HasPrefix(line, "SCHED ") {
			// The runtime's scheduler trace, not a relay log line: on a
			// host up more than 24.8 days it prints once at the start
			// (docs/configuration.md, "Where settings come from").
			continue
		}
		if err := checkDuplicateKeys([]byte(line)); err != nil {
			l.t.Errorf("log line repeats a key (%v): %s", err, line)
		}
		l.lines = append(l.lines, line)
	}
	return len(p), nil
}

// Lines returns the complete lines written so far.
func (l *logLines) Lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.lines...)
}
