//go:build unix && !linux

package main

import "syscall"

// childSysProcAttr puts a child in its own process group, so the terminal's
// Ctrl-C reaches only this tool, which stops its children in order. Outside
// Linux there is no parent-death signal: a killed tool leaves them running.
func childSysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
