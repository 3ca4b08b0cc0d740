//go:build !unix

package procs

import "time"

// processCPU is not measured here: the Sizer does not run.
var processCPU func() time.Duration
