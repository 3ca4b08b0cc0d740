package main

import (
	"io"
	"os"
	"sync"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

// Log formats (docs/configuration.md, "log"): every line carries its time
// to the millisecond, in UTC in JSON; durations are Go's duration text
// ("1m0s", "120ms", "1.5s") in both encoders, never bare numbers.
const (
	// jsonTimeFormat is the "time" field of a JSON line: RFC 3339 with
	// exactly three fractional digits, so that lines sort as text and a
	// pipeline's parser sees one shape.
	jsonTimeFormat = "2006-01-02T15:04:05.000Z07:00"
	// consoleTimeFormat is the time column of a console line, local time.
	consoleTimeFormat = "15:04:05.000"
)

// zerologOnce sets zerolog's process-wide settings, the one place they are
// set: the time field's format and clock, and how durations render.
var zerologOnce sync.Once

func configureZerolog() {
	zerologOnce.Do(func() {
		zerolog.TimeFieldFormat = jsonTimeFormat
		zerolog.TimestampFunc = func() time.Time { return time.Now().UTC() }
		zerolog.DurationFieldFormat = zerolog.DurationFormatString
	})
}

// newLogger builds the process logger writing to w from the log settings:
// format json, console, or auto (console when w is a terminal, JSON
// otherwise). Console output is colored only on a terminal and when
// NO_COLOR is unset (https://no-color.org), so that a pipe or a file never
// receives escape codes.
func newLogger(w io.Writer, lc config.LogConfig) zerolog.Logger {
	configureZerolog()
	level, err := zerolog.ParseLevel(lc.Level)
	if err != nil {
		level = zerolog.InfoLevel
	}
	terminal := isTerminal(w)
	out := w
	if lc.Format == "console" || lc.Format == "auto" && terminal {
		_, noColor := os.LookupEnv("NO_COLOR")
		out = zerolog.ConsoleWriter{Out: w, TimeFormat: consoleTimeFormat, NoColor: noColor || !terminal}
	}
	return zerolog.New(out).Level(level).With().Timestamp().Logger()
}

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && (isatty.IsTerminal(f.Fd()) || isatty.IsCygwinTerminal(f.Fd()))
}
