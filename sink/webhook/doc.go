// Package webhook delivers outbox events as HTTP POST requests: to an n8n
// Webhook node, or to any receiver that speaks Standard Webhooks.
//
// # Requests
//
// Every request carries Delivery.Body exactly as the engine computed it
// (envelope or nudge), and these headers:
//
//	Content-Type: application/json
//	Idempotency-Key, webhook-id  the id (IdempotencyKey): the event key, or
//	                             "evk_" + base64url(SHA-256(key)) when the key
//	                             is not header-safe; "~r<n>" appended for the
//	                             n-th replay
//	webhook-timestamp            unix seconds, taken afresh for every attempt
//	webhook-attempt              Delivery.Attempt
//	Outbox-Event-Key             the event key, only when it is header-safe
//	webhook-signature            standard-webhooks auth: "v1,<base64 HMAC>"
//	Authorization                jwt (Bearer, HS256) or basic auth
//	traceparent, tracestate      the producer's W3C trace context, when the
//	                             event has a valid one (relay.TraceHeaders):
//	                             the same on every attempt and replay
//
// plus the configured static headers and, for header auth, its header.
//
// With Format FormatCloudEvents the request is a CloudEvent in the binary
// content mode of the CloudEvents HTTP binding: the body is the event's
// payload (JSON null when NULL), Content-Type (datacontenttype) is
// application/json, and relay.CloudEventsHeaders adds ce-specversion,
// ce-id (the id above), ce-source, ce-type, ce-subject and ce-time. An
// event without a type is Permanent. See docs/ecosystem.md.
//
// # Batches
//
// With Config.Batch.MaxEvents > 0 a request carries up to that many events
// as a JSON array of {"id","attempt","event"} (plus "traceparent" and
// "tracestate" when the event has them), with Outbox-Batch-Size and a
// webhook-id and Idempotency-Key new for every request ("batch_" + random
// text): receivers dedupe on each element's id, never on the request's. A
// 2xx answer {"results":[{"id","result","message"}]} (or a bare array of
// them) settles each event by its own entry (ok; retry: Transient; fail:
// Permanent; no entry, a malformed one, two that disagree, or another
// value: Unknown); entries naming no event of the batch are ignored and
// logged. A 2xx answer over 4 MiB, or whose "results" is not an array,
// leaves every event Unknown; any other 2xx delivers them all; any other
// answer is classified as below and applies to every event of the batch.
// See docs/sinks.md "Batched delivery".
//
// # Outcomes
//
// A request is never re-sent by net/http itself (its GetBody is nil), so
// whether it was written decides the class of a failure without an answer.
// "Written" means the transport read the whole body; a request whose body
// was not read to its end cannot have reached the receiver complete (it has
// a Content-Length), and one whose write failed (httptrace WroteRequest with
// an error) did not either.
//
//	2xx                                    delivered (nil), except n8n's
//	                                         200 "n8n is starting up. Please
//	                                         wait" (Transient: it did not run)
//	409 with Treat409AsDelivered           delivered (nil)
//	TLS certificate refused by either side SinkDown: check tls.ca_file,
//	  (unknown CA, bad hostname, client      cert_file, key_file
//	  certificate missing or refused)
//	cannot connect (the host does not      SinkDown: check the sink's url and
//	  resolve, refused, dial timeout)        that the receiver is up
//	not written otherwise (TLS, reset or   Transient
//	  cancelled before the write)
//	written, then timeout, reset or EOF    Unknown
//	401, 403                               SinkDown: check the credentials
//	404 whose body says "is not            SinkDown: publish (activate) the
//	  registered" (n8n)                      n8n workflow
//	any other 404 (n8n's "Cannot POST"     SinkDown: the URL does not exist
//	  while it starts, a missing route)      (yet); check the sink's url
//	a status in PermanentStatuses          Permanent, with a body excerpt
//	408, 425, 429, 409, 5xx                Transient, Retry-After honoured
//	                                         (seconds or HTTP-date, <= 1h)
//	any other 4xx                          Permanent, with a body excerpt
//	3xx (redirects are not followed)       Transient
//	body over MaxBody, or empty            Permanent, nothing sent
//
// Sink-level answers (401, 403, 404) are checked first, so they can
// never dead-letter an event; PermanentStatuses is checked before the
// transient statuses, so listing 503 makes it permanent.
package webhook
