package natstest

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"strings"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nats.go"
)

// ReadCloudEvent reads a NATS message in the binary content mode of the
// CloudEvents NATS binding (version 1.0.3: every attribute a ce- header,
// decoded with one round of percent-decoding) with the CloudEvents Go SDK's
// binding machinery, and validates the event. The SDK's own NATS bindings
// read only the structured mode.
func ReadCloudEvent(header nats.Header, data []byte) (*event.Event, error) {
	m := natsMessage{header: header, data: data}
	if m.ReadEncoding() != binding.EncodingBinary {
		return nil, fmt.Errorf("not a binary-mode CloudEvent: no %s header", natsSpecs.PrefixedSpecVersionName())
	}
	ev, err := binding.ToEvent(context.Background(), m)
	if err != nil {
		return nil, err
	}
	return ev, ev.Validate()
}

// natsSpecs are the CloudEvents attributes as the NATS binding names its
// headers.
var natsSpecs = spec.WithPrefix("ce-")

type natsMessage struct {
	header nats.Header
	data   []byte
}

func (m natsMessage) version() spec.Version {
	return natsSpecs.Version(m.header.Get(natsSpecs.PrefixedSpecVersionName()))
}

func (m natsMessage) ReadEncoding() binding.Encoding {
	if m.version() != nil {
		return binding.EncodingBinary
	}
	return binding.EncodingUnknown
}

func (m natsMessage) ReadStructured(context.Context, binding.StructuredWriter) error {
	return binding.ErrNotStructured
}

func (m natsMessage) ReadBinary(_ context.Context, w binding.BinaryWriter) error {
	v := m.version()
	for name, values := range m.header {
		value, err := url.PathUnescape(values[0])
		if err != nil {
			return fmt.Errorf("header %s: %w", name, err)
		}
		if attr := v.Attribute(name); attr != nil {
			err = w.SetAttribute(attr, value)
		} else if ext, ok := strings.CutPrefix(name, "ce-"); ok {
			err = w.SetExtension(ext, value)
		}
		if err != nil {
			return err
		}
	}
	return w.SetData(bytes.NewReader(m.data))
}

func (m natsMessage) GetAttribute(k spec.Kind) (spec.Attribute, any) {
	attr := m.version().AttributeFromKind(k)
	if attr == nil {
		return nil, nil
	}
	if v := m.header.Get(attr.PrefixedName()); v != "" {
		return attr, v
	}
	return attr, nil
}

func (m natsMessage) GetExtension(name string) any {
	if v := m.header.Get("ce-" + name); v != "" {
		return v
	}
	return nil
}

func (m natsMessage) Finish(error) error { return nil }
