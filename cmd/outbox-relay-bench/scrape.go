package main

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// histogram is a Prometheus histogram's cumulative bucket counts, by upper
// bound in seconds.
type histogram map[float64]float64

// scrapeHistogram reads the buckets of the histogram name from the
// Prometheus text exposition at url.
func scrapeHistogram(ctx context.Context, url, name string) (histogram, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scrape %s: %s", url, resp.Status)
	}
	return parseHistogram(bufio.NewScanner(resp.Body), name)
}

// parseHistogram picks name's `_bucket{le="…"} count` lines out of a text
// exposition.
func parseHistogram(sc *bufio.Scanner, name string) (histogram, error) {
	h := histogram{}
	prefix := name + `_bucket{le="`
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, prefix)
		if !ok {
			continue
		}
		le, count, ok := strings.Cut(rest, `"} `)
		if !ok {
			return nil, fmt.Errorf("unexpected bucket line %q", line)
		}
		bound, err := strconv.ParseFloat(le, 64) // "+Inf" parses as +Inf
		if err != nil {
			return nil, fmt.Errorf("bucket bound in %q: %w", line, err)
		}
		n, err := strconv.ParseFloat(strings.Fields(count)[0], 64)
		if err != nil {
			return nil, fmt.Errorf("bucket count in %q: %w", line, err)
		}
		h[bound] = n
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(h) == 0 {
		return nil, fmt.Errorf("no %s buckets", name)
	}
	return h, nil
}

// since returns h minus an earlier scrape of the same histogram.
func (h histogram) since(earlier histogram) histogram {
	d := histogram{}
	for le, n := range h {
		d[le] = n - earlier[le]
	}
	return d
}

// over returns how many observations were above bound (which must be one
// of the bucket bounds) and how many there were in all.
func (h histogram) over(bound float64) (over, total float64) {
	total = h[inf]
	return total - h[bound], total
}

var inf, _ = strconv.ParseFloat("+Inf", 64)
