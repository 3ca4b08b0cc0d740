package nats

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/rs/zerolog"
)

// embeddedReadyTimeout bounds how long StartEmbedded waits for the server to
// accept connections.
const embeddedReadyTimeout = 10 * time.Second

// StartEmbedded starts a NATS server with JetStream inside the process, for
// the zero-config single-instance setup: it listens on a free 127.0.0.1 port
// and stores JetStream data under dataDir/nats. It returns the server and
// its client URL; the caller owns the server and must call Shutdown (and
// WaitForShutdown) when done.
//
// syncAlways makes JetStream fsync every write before acknowledging it.
// nats-server by default acknowledges before fsync and syncs in the
// background every two minutes, so a machine crash can lose messages it
// already acknowledged — and the relay treats a PubAck as delivered. The
// relay passes true unless configured otherwise; false trades that
// guarantee for publish throughput.
//
// The server does not handle signals (the relay does) and logs through log:
// its notices at debug level, warnings and errors as such.
func StartEmbedded(dataDir string, syncAlways bool, log zerolog.Logger) (*server.Server, string, error) {
	if dataDir == "" {
		return nil, "", fmt.Errorf("embedded nats server: data_dir is empty")
	}
	storeDir := filepath.Join(dataDir, "nats")
	if err := os.MkdirAll(storeDir, 0o700); err != nil {
		return nil, "", fmt.Errorf("embedded nats server: %w", err)
	}
	opts := &server.Options{
		ServerName: "outbox-relay",
		Host:       "127.0.0.1",
		Port:       server.RANDOM_PORT,
		JetStream:  true,
		StoreDir:   storeDir,
		SyncAlways: syncAlways,
		NoSigs:     true,
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, "", fmt.Errorf("embedded nats server: %w", err)
	}
	srv.SetLogger(serverLogger{log: log.With().Str("component", "nats-server").Logger()}, false, false)
	// Start returns at once; the server runs in its own goroutines until
	// Shutdown.
	srv.Start()
	if !srv.ReadyForConnections(embeddedReadyTimeout) {
		srv.Shutdown()
		srv.WaitForShutdown()
		return nil, "", fmt.Errorf("embedded nats server: not ready for connections within %s (store %s)", embeddedReadyTimeout, storeDir)
	}
	url := srv.ClientURL()
	log.Info().Str("url", url).Str("store_dir", storeDir).Bool("sync_always", syncAlways).
		Msg("embedded NATS server started")
	return srv, url, nil
}

// serverLogger adapts zerolog to nats-server's Logger.
type serverLogger struct{ log zerolog.Logger }

func (l serverLogger) Noticef(format string, v ...any) { l.log.Debug().Msgf(format, v...) }
func (l serverLogger) Warnf(format string, v ...any)   { l.log.Warn().Msgf(format, v...) }
func (l serverLogger) Fatalf(format string, v ...any)  { l.log.Error().Msgf(format, v...) }
func (l serverLogger) Errorf(format string, v ...any)  { l.log.Error().Msgf(format, v...) }
func (l serverLogger) Debugf(format string, v ...any)  { l.log.Trace().Msgf(format, v...) }
func (l serverLogger) Tracef(format string, v ...any)  { l.log.Trace().Msgf(format, v...) }
