package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/relay"
)

// The ecosystem features of run (docs/ecosystem.md): the CloudEvents source
// of sinks with format cloudevents, and OpenTelemetry tracing of deliveries.

// fillCloudEventsSources sets cloudevents.source of every sink with format
// cloudevents that has none to "/<database>/<schema>/<table>".
func fillCloudEventsSources(ctx context.Context, pool *pgxpool.Pool, cfg *config.Config, outbox relay.QualifiedName) error {
	var database string
	for i := range cfg.Sinks {
		sc := &cfg.Sinks[i]
		if sc.Format != config.FormatCloudEvents || sc.CloudEvents.Source != "" {
			continue
		}
		if database == "" {
			if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&database); err != nil {
				return fmt.Errorf("read the database name for the CloudEvents source of sinks[%d] (%s): %w", i, sc.Name, err)
			}
		}
		sc.CloudEvents.Source = sc.CloudEventsSource(database, outbox)
	}
	return nil
}

// OpenTelemetry's standard environment, as far as run reads it itself; the
// SDK and the exporter read the rest (OTEL_EXPORTER_OTLP_HEADERS, _TIMEOUT,
// _COMPRESSION, _CERTIFICATE, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
// OTEL_TRACES_SAMPLER, OTEL_BSP_*).
const (
	envOTLPEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envOTLPTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envOTLPProtocol       = "OTEL_EXPORTER_OTLP_PROTOCOL"
	envOTLPTracesProtocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	envSDKDisabled        = "OTEL_SDK_DISABLED"
	envTracesExporter     = "OTEL_TRACES_EXPORTER"
)

// newTracerProvider returns the tracer provider that exports a span per
// delivery attempt over OTLP/HTTP, when the environment names an OTLP
// endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
// and neither OTEL_SDK_DISABLED=true nor an OTEL_TRACES_EXPORTER other than
// otlp turns it off; otherwise nil, and nothing is exported. It fails when
// the environment asks for a protocol other than http/protobuf: this build
// carries only the HTTP exporter. Export errors are logged, never fatal.
// The caller shuts the provider down, which flushes the spans.
func newTracerProvider(ctx context.Context, log zerolog.Logger) (*sdktrace.TracerProvider, error) {
	if os.Getenv(envOTLPEndpoint) == "" && os.Getenv(envOTLPTracesEndpoint) == "" {
		return nil, nil
	}
	if strings.EqualFold(strings.TrimSpace(os.Getenv(envSDKDisabled)), "true") {
		log.Info().Msg("OpenTelemetry: OTEL_SDK_DISABLED=true, no spans are exported")
		return nil, nil
	}
	if exp := strings.TrimSpace(os.Getenv(envTracesExporter)); exp != "" && exp != "otlp" {
		log.Info().Str(envTracesExporter, exp).Msg("OpenTelemetry: no OTLP trace exporter asked for, no spans are exported")
		return nil, nil
	}
	protocol := os.Getenv(envOTLPTracesProtocol)
	if protocol == "" {
		protocol = os.Getenv(envOTLPProtocol)
	}
	if protocol != "" && protocol != "http/protobuf" {
		return nil, fmt.Errorf("OpenTelemetry: OTLP protocol %q asked for (%s or %s): outbox-relay exports over http/protobuf only; unset it, and point the endpoint at the collector's OTLP/HTTP port (4318 by default)",
			protocol, envOTLPProtocol, envOTLPTracesProtocol)
	}
	// Both read the standard environment: endpoint, headers, timeout,
	// compression, TLS.
	exporter, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("OpenTelemetry: OTLP trace exporter: %w", err)
	}
	// Later detectors win: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
	// override the defaults.
	res, err := resource.New(ctx,
		resource.WithTelemetrySDK(),
		resource.WithAttributes(attribute.String("service.name", "outbox-relay"), attribute.String("service.version", version)),
		resource.WithFromEnv())
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, fmt.Errorf("OpenTelemetry: resource: %w", err)
	}
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		log.Warn().Err(err).Msg("OpenTelemetry: exporting spans failed")
	}))
	// The sampler follows OTEL_TRACES_SAMPLER; by default a span is sampled
	// when the producer's was (parent-based), and always without a parent.
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	endpoint := os.Getenv(envOTLPTracesEndpoint)
	if endpoint == "" {
		endpoint = os.Getenv(envOTLPEndpoint)
	}
	log.Info().Str("endpoint", redactEndpoint(endpoint)).Msg("OpenTelemetry: exporting a span per delivery attempt over OTLP/HTTP")
	return tp, nil
}

// redactEndpoint drops the user information and query of an endpoint URL
// for the log.
func redactEndpoint(endpoint string) string {
	if i := strings.Index(endpoint, "://"); i >= 0 {
		rest := endpoint[i+3:]
		if at := strings.LastIndex(rest, "@"); at >= 0 && !strings.ContainsAny(rest[:at], "/?#") {
			endpoint = endpoint[:i+3] + rest[at+1:]
		}
	}
	if q := strings.IndexAny(endpoint, "?#"); q >= 0 {
		endpoint = endpoint[:q]
	}
	return endpoint
}

// traceDeliveries wraps the routes' sinks so that every delivery attempt is
// a span, when newTracerProvider returns a provider; it returns the routes
// and a function that flushes and stops the provider (a no-op without one).
func traceDeliveries(ctx context.Context, routes []relay.Route, log zerolog.Logger) ([]relay.Route, func(), error) {
	tp, err := newTracerProvider(ctx, log)
	if err != nil || tp == nil {
		return routes, func() {}, err
	}
	shutdown := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(ctx); err != nil {
			log.Warn().Err(err).Msg("OpenTelemetry: flush spans at exit")
		}
	}
	return relay.TraceRoutes(routes, tp), shutdown, nil
}
