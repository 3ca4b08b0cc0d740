package nats

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// DefaultDuplicateWindow is the stream duplicate window the sink expects
// (and creates the stream with) when StreamConfig.DuplicateWindow is zero.
// It covers the re-send that follows an unknown outcome through the first
// five steps of the default delivery backoff (gaps up to 5 minutes plus
// jitter) and a relay restarted within minutes; each message id in the
// window costs the server memory (docs/jetstream-cluster.md, "The stream").
const DefaultDuplicateWindow = 10 * time.Minute

// DefaultStreamName is the stream used when StreamConfig.Name is empty.
const DefaultStreamName = "OUTBOX"

// ensureStream checks that the configured stream exists, captures every
// subject the template can render and deduplicates over at least the
// configured window, creating it first when it is missing and create is set.
// It returns the stream's max_msg_size, or 0 when unlimited.
func (s *Sink) ensureStream(ctx context.Context, cfg StreamConfig, create bool, pattern string) (int64, error) {
	name := cfg.Name
	stream, err := s.js.Stream(ctx, name)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound) && create:
		stream, err = s.createStream(ctx, cfg, pattern)
		if err != nil {
			return 0, err
		}
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return 0, fmt.Errorf("stream %q does not exist: create it (nats stream add %s --subjects %q --dupe-window %s --storage file) or set the sink's stream.create: true",
			name, name, literalPrefix(pattern), cfg.DuplicateWindow)
	case errors.Is(err, jetstream.ErrJetStreamNotEnabled), errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount):
		return 0, fmt.Errorf("look up stream %q: %w: enable JetStream on the server (jetstream {} in its config, or -js) and for the account", name, err)
	case err != nil:
		return 0, fmt.Errorf("look up stream %q: %w", name, err)
	}
	info := stream.CachedInfo()
	sc := info.Config

	covered := false
	for _, f := range sc.Subjects {
		if subjectCovers(f, pattern) {
			covered = true
			break
		}
	}
	if !covered {
		hint := ""
		if other, err := s.js.StreamNameBySubject(ctx, sampleSubject(pattern)); err == nil && other != name {
			hint = fmt.Sprintf(" (they go to stream %q)", other)
		}
		return 0, fmt.Errorf("stream %q (subjects %q) does not capture the sink's subjects %q%s: add a subject such as %q to the stream (nats stream edit %s --subjects ...) or change the sink's subject template",
			name, sc.Subjects, pattern, hint, literalPrefix(pattern), name)
	}
	if sc.Duplicates < cfg.DuplicateWindow {
		// A short window costs a second copy of a late re-send (counted, and
		// carrying the same event key), never an event: the stream is used.
		s.log.Warn().Str("stream", name).Str("stream_duplicate_window", sc.Duplicates.String()).Str("duplicate_window", cfg.DuplicateWindow.String()).
			Str("fix", fmt.Sprintf("nats stream edit %s --dupe-window %s", name, cfg.DuplicateWindow)).
			Msg("the stream's duplicate window is shorter than the sink's stream.duplicate_window: a re-send after it stores a second copy (outbox_relay_nats_duplicates_stored_total)")
	}
	if sc.NoAck {
		return 0, fmt.Errorf("stream %q has no_ack set, so publishes are never acknowledged: the sink needs acknowledgements (nats stream edit %s --ack)", name, name)
	}
	if sc.Sealed {
		return 0, fmt.Errorf("stream %q is sealed and takes no new messages: use another stream", name)
	}
	if sc.MaxMsgSize > 0 {
		return int64(sc.MaxMsgSize), nil
	}
	return 0, nil
}

func (s *Sink) createStream(ctx context.Context, cfg StreamConfig, pattern string) (jetstream.Stream, error) {
	subjects := cfg.Subjects
	if len(subjects) == 0 {
		subjects = []string{literalPrefix(pattern)}
	}
	sc := jetstream.StreamConfig{
		Name:       cfg.Name,
		Subjects:   subjects,
		Storage:    jetstream.FileStorage,
		Duplicates: cfg.DuplicateWindow,
	}
	if cfg.MaxMsgSize > 0 {
		// New checked that it fits.
		sc.MaxMsgSize = int32(cfg.MaxMsgSize)
	}
	stream, err := s.js.CreateStream(ctx, sc)
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		// Created concurrently by another relay: check what it made.
		stream, err = s.js.Stream(ctx, cfg.Name)
	}
	if err != nil {
		return nil, fmt.Errorf("create stream %q (subjects %q, duplicate_window %s): %w", cfg.Name, subjects, cfg.DuplicateWindow, err)
	}
	s.log.Info().Str("stream", cfg.Name).Strs("subjects", subjects).Dur("duplicate_window", cfg.DuplicateWindow).
		Msg("created JetStream stream")
	return stream, nil
}

// sampleSubject turns a pattern into one literal subject it matches.
func sampleSubject(pattern string) string {
	b := []byte(pattern)
	for i := range b {
		if b[i] == '*' && (i == 0 || b[i-1] == '.') && (i == len(b)-1 || b[i+1] == '.') {
			b[i] = '_'
		}
	}
	return string(b)
}
