package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

const consoleToken = "console-admin-token-0123456789"

// consoleRelay is the relay binary with the admin API on, and its address.
type consoleRelay struct {
	*setup
	base string // http://127.0.0.1:port
	logs *syncBuffer
}

// startConsoleRelay runs the built relay binary (as operators run it: the
// page is embedded in it) against a private PostgreSQL, a NATS server and a
// webhook receiver, with http.admin_token set.
func startConsoleRelay(t *testing.T) *consoleRelay {
	t.Helper()
	s := newSetup(t, pgtest.NewDatabase(t))
	path := s.configFile(t, "")
	cfg, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	withAdmin := strings.Replace(string(cfg), `http: {listen: "127.0.0.1:0"}`, `http: {listen: "127.0.0.1:0", admin_token: "`+consoleToken+`"}`, 1)
	if withAdmin == string(cfg) {
		t.Fatal("the setup's configuration has no http line to change")
	}
	if err := os.WriteFile(path, []byte(withAdmin), 0o600); err != nil {
		t.Fatal(err)
	}
	r := &consoleRelay{setup: s, logs: &syncBuffer{}}
	s.startProcess(t, path, r.logs)
	re := regexp.MustCompile(`"listen":"([^"]+)"[^\n]*serving /metrics`)
	eventually(t, 30*time.Second, "the relay's HTTP listener in its log", func() bool {
		if m := re.FindStringSubmatch(r.logs.String()); m != nil {
			r.base = "http://" + m[1]
		}
		return r.base != ""
	})
	s.waitSlot(t)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("relay log:\n%s", r.logs.String())
		}
	})
	return r
}

// get answers GET path with the admin token, decoded into v.
func (r *consoleRelay) get(t *testing.T, path string, v any) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, r.base+path, nil)
	req.Header.Set("Authorization", "Bearer "+consoleToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d", path, resp.StatusCode)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
}

// publish inserts one event through outbox_publish.
func (r *consoleRelay) publish(t *testing.T, key, eventType string) {
	t.Helper()
	var res string
	if err := r.pool.QueryRow(context.Background(), `SELECT outbox_publish($1, 'order', $2, $2, jsonb_build_object('card', 'PAYLOAD-SECRET'))`,
		eventType, key).Scan(&res); err != nil {
		t.Fatalf("publish %s: %v", key, err)
	}
}

// publishTo inserts one event of aggregate order/agg.
func (r *consoleRelay) publishTo(t *testing.T, key, agg string) {
	t.Helper()
	var res string
	if err := r.pool.QueryRow(context.Background(), `SELECT outbox_publish('order.placed', 'order', $1, $2, '{}')`, agg, key).Scan(&res); err != nil {
		t.Fatalf("publish %s: %v", key, err)
	}
}

// TestConsoleAPI_FeedAndFlow: the live feed shows each delivery as the
// relay makes it — key, type, sink, outcome, latency, and no payload — from
// the relay's memory, and the status counts the deliveries per sink.
func TestConsoleAPI_FeedAndFlow(t *testing.T) {
	r := startConsoleRelay(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, r.base+"/api/v1/feed", nil)
	req.Header.Set("Authorization", "Bearer "+consoleToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("feed: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	for i := range 20 {
		r.publish(t, fmt.Sprintf("feed-%d", i), "order.placed")
	}

	got := map[string]int{}
	lines := bufio.NewScanner(resp.Body)
	event := ""
	for len(got) < 40 && lines.Scan() {
		line := lines.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: ") && event == "delivery":
			data := strings.TrimPrefix(line, "data: ")
			if strings.Contains(data, "PAYLOAD-SECRET") || strings.Contains(data, `"payload"`) {
				t.Fatalf("the feed shows a payload: %s", data)
			}
			var d struct {
				Sink, EventKey, EventType, Outcome, Path string
				LatencySeconds                           float64
				ID                                       int64
			}
			if err := json.Unmarshal([]byte(data), &struct {
				Sink           *string  `json:"sink"`
				EventKey       *string  `json:"event_key"`
				EventType      *string  `json:"event_type"`
				Outcome        *string  `json:"outcome"`
				Path           *string  `json:"path"`
				LatencySeconds *float64 `json:"latency_seconds"`
				ID             *int64   `json:"id"`
			}{&d.Sink, &d.EventKey, &d.EventType, &d.Outcome, &d.Path, &d.LatencySeconds, &d.ID}); err != nil {
				t.Fatalf("feed item %s: %v", data, err)
			}
			if d.Outcome != "delivered" || d.EventType != "order.placed" || !strings.HasPrefix(d.EventKey, "feed-") || d.ID == 0 ||
				d.LatencySeconds <= 0 || d.LatencySeconds > 30 || (d.Sink != "hook" && d.Sink != "nats") || d.Path != "stream" {
				t.Fatalf("feed item: %s", data)
			}
			got[d.Sink+" "+d.EventKey]++
		}
	}
	if len(got) != 40 {
		t.Fatalf("the feed showed %d deliveries, want 40 (20 events, 2 sinks): %v (%v)", len(got), got, lines.Err())
	}

	eventually(t, 30*time.Second, "the status to count 20 deliveries per sink", func() bool {
		var st struct {
			State string `json:"state"`
			Sinks []struct {
				Name       string `json:"name"`
				SinceStart struct {
					Delivered float64 `json:"delivered"`
				} `json:"since_start"`
			} `json:"sinks"`
		}
		r.get(t, "/api/v1/status", &st)
		n := 0
		for _, s := range st.Sinks {
			if s.SinceStart.Delivered == 20 {
				n++
			}
		}
		return n == 2 && st.State == "flowing"
	})
}

// chromiumPath finds Debian's chromium; under CI=true a missing browser
// fails the test (.ci/run installs it), elsewhere it skips.
func chromiumPath(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("chromium is missing: the console's browser test needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
	}
	t.Skip("chromium is not installed (apt-get update && apt-get install -y chromium)")
	return ""
}

// screenshots is where the browser test writes its PNG files: the
// directory $OUTBOX_RELAY_SCREENSHOTS names, or a new one under the
// system's temporary directory; it is kept, and logged.
func screenshots(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("OUTBOX_RELAY_SCREENSHOTS")
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "outbox-relay-console-"); err != nil {
			t.Fatal(err)
		}
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshots in %s", dir)
	return dir
}

// TestConsole_Browser drives the console in a real browser against the
// relay binary: the page loads and signs in; its counters move while events
// flow, and the live feed shows them; a dead letter shows in its tab, and
// retried from the page, it is delivered; the event lookup shows it done.
// Each state is a screenshot.
func TestConsole_Browser(t *testing.T) {
	chromium := chromiumPath(t)
	r := startConsoleRelay(t)
	shots := screenshots(t)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx,
		chromedp.ExecPath(chromium),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("force-color-profile", "srgb"),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1440, 1000),
	)
	defer cancelAlloc()
	browser, cancelBrowser := chromedp.NewContext(alloc, chromedp.WithErrorf(t.Logf))
	defer cancelBrowser()

	do := func(what string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(browser, actions...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	// waitJS waits, at most 60 s, until the expression is true in the page.
	waitJS := func(what, expr string) {
		t.Helper()
		if _, err := chromedp.Run(browser, chromedp.Poll[bool](expr, chromedp.WithPollingInterval(100*time.Millisecond), chromedp.WithPollingTimeout(60*time.Second))); err != nil {
			t.Fatalf("waiting for %s (%s): %v", what, expr, err)
		}
	}
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS(sel)))
		if err != nil {
			t.Fatalf("text of %s: %v", sel, err)
		}
		return s
	}
	shot := func(name string) {
		t.Helper()
		png, err := chromedp.Run(browser, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatalf("screenshot %s: %v", name, err)
		}
		if err := os.WriteFile(filepath.Join(shots, name+".png"), png, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	// The page loads and asks for the token.
	do("open the console", chromedp.Navigate(r.base+"/console/"), chromedp.WaitVisible(chromedp.ID("token")))
	shot("1-sign-in")
	do("sign in", chromedp.SendKeys(chromedp.ID("token"), consoleToken), chromedp.Click(chromedp.ID("signin")))
	waitJS("the overview", `document.getElementById("state").dataset.state !== "unknown" && document.querySelectorAll("#sinks tbody tr").length === 2`)

	// Events flow: the delivered counters move and the feed shows them.
	delivered := func() int {
		t.Helper()
		n, err := strconv.Atoi(strings.ReplaceAll(text(`#sinks tbody tr:nth-child(2) td:nth-child(5)`), ",", ""))
		if err != nil {
			t.Fatalf("the hook's delivered count: %v", err)
		}
		return n
	}
	flowing := make(chan struct{})
	go func() {
		defer close(flowing)
		for i := 0; i < 300 && ctx.Err() == nil; i++ {
			r.publish(t, fmt.Sprintf("console-%d", i), []string{"order.placed", "order.paid", "invoice.sent"}[i%3])
			time.Sleep(20 * time.Millisecond)
		}
	}()
	waitJS("deliveries counted", `Number(document.querySelector("#sinks tbody tr:nth-child(2) td:nth-child(5)").textContent.replace(/,/g, "")) > 0`)
	first := delivered()
	waitJS("the counter to move", fmt.Sprintf(`Number(document.querySelector("#sinks tbody tr:nth-child(2) td:nth-child(5)").textContent.replace(/,/g, "")) > %d`, first))
	waitJS("the live feed", `document.querySelectorAll("#feed tbody tr").length >= 20`)
	waitJS("the state flowing", `document.getElementById("state").dataset.state === "flowing"`)
	if second := delivered(); second <= first {
		t.Errorf("the delivered counter did not move: %d, then %d", first, second)
	}
	if feed := text("#feed tbody"); strings.Contains(feed, "PAYLOAD-SECRET") {
		t.Errorf("the feed shows a payload: %s", feed)
	}
	shot("2-overview-flowing")
	<-flowing

	// Paused from the page, the webhook gets nothing while NATS gets every
	// event; resumed, it gets the held events in per-aggregate order.
	do("pause the hook", chromedp.Click(chromedp.ID("pause-hook")))
	waitJS("the hook shown paused", `document.getElementById("sink-state-hook")?.textContent === "paused" && document.getElementById("resume-hook") !== null`)
	eventually(t, 5*time.Second, "the relay to notice the pause", func() bool { return strings.Contains(r.logs.String(), "sink paused") })
	var held []string
	for i := range 12 {
		key := fmt.Sprintf("held-%d", i)
		held = append(held, key)
		r.publishTo(t, key, fmt.Sprintf("held-agg-%d", i%3))
	}
	eventually(t, 30*time.Second, "the held events at NATS", func() bool {
		msgs := byKey(streamMessages(t, r.nats.URL()))
		for _, k := range held {
			if len(msgs[k]) == 0 {
				return false
			}
		}
		return true
	})
	for _, d := range r.hook.deliveries() {
		if strings.HasPrefix(d.EventKey, "held-") {
			t.Fatalf("the paused webhook got %s", d.EventKey)
		}
	}
	shot("2a-sink-paused")
	do("resume the hook", chromedp.Click(chromedp.ID("resume-hook")))
	waitJS("the hook shown delivering", `document.getElementById("sink-state-hook")?.textContent === "delivering"`)
	eventually(t, 30*time.Second, "the held events at the webhook", func() bool {
		got := byKey(r.hook.deliveries())
		for _, k := range held {
			if len(got[k]) == 0 {
				return false
			}
		}
		return true
	})
	checkOrder(t, "webhook", r.hook.deliveries())
	shot("2b-sink-resumed")
	if logs := r.logs.String(); !strings.Contains(logs, `"action":"pause","sink":"hook"`) || !strings.Contains(logs, `"action":"resume","sink":"hook"`) {
		t.Errorf("the pause and the resume are not logged")
	}

	// A dead letter: the webhook refuses one event for good.
	r.hook.setReply(func(d delivery) int {
		if d.EventKey == "console-bad" {
			return http.StatusBadRequest
		}
		return http.StatusNoContent
	})
	r.publish(t, "console-bad", "order.placed")
	var id int64
	eventually(t, 30*time.Second, "console-bad dead-lettered", func() bool {
		err := r.pool.QueryRow(context.Background(), `SELECT id FROM integration_outbox WHERE event_key = 'console-bad' AND status = 'failed'`).Scan(&id)
		return err == nil
	})
	do("open the dead letters", chromedp.Click(chromedp.CSS(`.tabs button[data-tab="dlq"]`)))
	row := fmt.Sprintf(`#dlq tbody tr[data-id="%d"]`, id)
	waitJS("the dead letter in its tab", fmt.Sprintf(`document.querySelector(%q) !== null`, row))
	if got := text(row); !strings.Contains(got, "console-bad") || !strings.Contains(got, "400") {
		t.Errorf("the dead letter's row: %q", got)
	}
	waitJS("the count on the tab", `document.getElementById("dlq-count").textContent === "1"`)
	shot("3-dead-letter")

	// Retried from the page, it is delivered.
	r.hook.setReply(nil)
	do("retry it", chromedp.Click(chromedp.CSS(row+` button.act:not(.danger)`)))
	waitJS("the retry's result", `document.getElementById("dlq-result").textContent.startsWith("retried 1 event")`)
	eventually(t, 30*time.Second, "console-bad delivered to the webhook", func() bool {
		return len(byKey(r.hook.deliveries())["console-bad"]) == 1
	})
	r.waitDone(t, "event_key = 'console-bad'", 1)
	waitJS("the dead letters empty", `document.querySelectorAll("#dlq tbody tr").length === 0 && document.getElementById("dlq-count").textContent === ""`)
	shot("4-retried")
	if logs := r.logs.String(); !regexp.MustCompile(`"action":"retry"[^\n]*"rows":1[^\n]*"from":"127\.0\.0\.1:`).MatchString(logs) {
		t.Errorf("the retry is not logged with its rows and address")
	}

	// The event lookup tells its story: done, delivered to both sinks.
	do("look the event up", chromedp.Click(chromedp.CSS(`.tabs button[data-tab="lookup"]`)),
		chromedp.SendKeys(chromedp.CSS(`#lookup-form input[name="ref"]`), "console-bad"),
		chromedp.Click(chromedp.CSS(`#lookup-form button[type="submit"]`)))
	waitJS("the event's report", `document.querySelector("#lookup-result .report") !== null`)
	if got := text("#lookup-result"); !strings.Contains(got, "console-bad") || !strings.Contains(got, "done") || strings.Contains(got, "PAYLOAD-SECRET") {
		t.Errorf("the event's report: %q", got)
	}
	shot("5-event-lookup")

	// The feed showed the dead letter and the retried delivery.
	do("back to the feed", chromedp.Click(chromedp.CSS(`.tabs button[data-tab="feed"]`)))
	waitJS("the failed outcome in the feed", `Array.from(document.querySelectorAll("#feed tbody tr")).some((tr) => tr.textContent.includes("console-bad") && tr.textContent.includes("failed"))`)
}

// TestConsole_FeedEndsWithTheRelay: a client reading the live feed does
// not outlive the relay: when run stops, the feed's stream ends and run
// returns, rather than the HTTP server's shutdown giving up on a handler
// that never returns.
func TestConsole_FeedEndsWithTheRelay(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	path := s.configFile(t, "")
	cfg, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(strings.Replace(string(cfg), `http: {listen: "127.0.0.1:0"}`,
		`http: {listen: "127.0.0.1:0", admin_token: "`+consoleToken+`"}`, 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	stop := runInProcess(t, config.Options{Path: path}, zerolog.New(logs))
	re := regexp.MustCompile(`"listen":"([^"]+)"[^\n]*serving /metrics`)
	var base string
	eventually(t, 30*time.Second, "the relay's HTTP listener in its log", func() bool {
		if m := re.FindStringSubmatch(logs.String()); m != nil {
			base = "http://" + m[1]
		}
		return base != ""
	})
	s.waitSlot(t) // started: a stop now is a stop of a running relay
	req, _ := http.NewRequest(http.MethodGet, base+"/api/v1/feed", nil)
	req.Header.Set("Authorization", "Bearer "+consoleToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	ended := make(chan error, 1)
	go func() {
		_, err := io.Copy(io.Discard, resp.Body)
		ended <- err
	}()

	stopped := make(chan struct{})
	start := time.Now()
	go func() { stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("run did not return within 30 s with a live feed open")
	}
	select {
	case err := <-ended:
		t.Logf("the feed ended (%v) and run returned after %s", err, time.Since(start).Round(time.Millisecond))
	case <-time.After(5 * time.Second):
		t.Fatal("the feed's stream did not end when the relay stopped")
	}
	if strings.Contains(logs.String(), "http server") {
		t.Errorf("the HTTP server logged an error:\n%s", logs.String())
	}
}
