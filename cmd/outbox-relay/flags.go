package main

import "time"

// durationFlag is a time.Duration flag that names the flag in its error.
type durationFlag time.Duration

func (d *durationFlag) String() string { return time.Duration(*d).String() }

func (d *durationFlag) Set(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = durationFlag(v)
	return nil
}

func (d *durationFlag) Type() string { return "duration" }

func (d durationFlag) Duration() time.Duration { return time.Duration(d) }
