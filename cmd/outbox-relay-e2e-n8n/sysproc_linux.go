package main

import "syscall"

// childSysProcAttr puts a child in its own process group (so the terminal's
// Ctrl-C reaches only this tool, which stops its children in order) and has
// the kernel send it SIGTERM if this tool dies first.
func childSysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
}
