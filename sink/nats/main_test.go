package nats_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a test leaves a goroutine behind
// (docs/architecture.md, "Goroutines and their owners").
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
