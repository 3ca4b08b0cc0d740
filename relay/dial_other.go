//go:build !linux

package relay

import "time"

func setUserTimeout(uintptr, time.Duration) error { return nil }
