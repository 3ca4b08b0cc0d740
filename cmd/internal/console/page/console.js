// The outbox-relay console: it reads and acts through the admin API
// (../api/v1/), with the token kept in sessionStorage and sent as a bearer
// header. Every value from the API is written as text, never as markup.
"use strict";

const API = new URL("../api/v1/", location.href).pathname;
const TOKEN_KEY = "outbox-relay-admin-token";
const STATUS_EVERY = 2000;
const FEED_ROWS = 200;

const $ = (id) => document.getElementById(id);
let token = sessionStorage.getItem(TOKEN_KEY) || "";
let access = "";
let sinks = [];
let statusTimer = null;
let feedAbort = null;
let feedPaused = false;
let feedSeen = 0;
let feedDropped = 0;
let dlqAfter = null;
let dlqShown = [];
let dlqPaged = false;
let activeTab = "feed";

// --- the API ----------------------------------------------------------------

async function api(path, options = {}) {
  const headers = { Authorization: "Bearer " + token };
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  let res;
  try {
    res = await fetch(API + path, {
      method: options.method || "GET",
      headers,
      body: options.body === undefined ? undefined : JSON.stringify(options.body),
      cache: "no-store",
      credentials: "omit",
    });
  } catch (e) {
    return { ok: false, status: 0, body: { error: "the relay does not answer (" + e.message + ")" } };
  }
  let body = {};
  try { body = await res.json(); } catch (e) { body = { error: res.status + " " + res.statusText }; }
  if (res.status === 401) signOut("The token was refused: " + (body.error || "unauthorized"));
  return { ok: res.ok, status: res.status, body };
}

// --- sign in and out --------------------------------------------------------

function signIn(t) {
  token = t.trim();
  sessionStorage.setItem(TOKEN_KEY, token);
  $("login").hidden = true;
  $("app").hidden = false;
  $("signout").hidden = false;
  $("login-error").textContent = "";
  pollStatus();
  startFeed();
}

function signOut(message) {
  token = "";
  sessionStorage.removeItem(TOKEN_KEY);
  clearTimeout(statusTimer);
  if (feedAbort) feedAbort.abort();
  feedAbort = null;
  $("app").hidden = true;
  $("signout").hidden = true;
  $("access").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  setState("unknown", "signed out", "");
  $("token").focus();
}

// --- formatting -------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

function num(n, digits = 0) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
}

function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 0.001) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function ago(iso) {
  if (!iso) return "–";
  return seconds(Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000)) + " ago";
}

function time(iso) {
  const d = new Date(iso);
  return d.toLocaleTimeString("en-GB", { hour12: false }) + "." + String(d.getMilliseconds()).padStart(3, "0");
}

function setText(id, text) {
  const e = $(id);
  e.textContent = text;
  if (e.classList.contains("sub")) e.title = text;
}

function setState(state, text, summary) {
  $("state").dataset.state = state;
  setText("state-text", text);
  setText("summary", summary);
}

// --- the overview -----------------------------------------------------------

async function pollStatus() {
  clearTimeout(statusTimer);
  if (!token) return;
  const res = await api("status");
  if (!token) return;
  if (res.ok) {
    $("banner").hidden = true;
    renderStatus(res.body);
  } else {
    $("banner").hidden = false;
    $("banner").textContent = res.body.error || "status: " + res.status;
    setState("error", "no status", res.body.error || "");
  }
  statusTimer = setTimeout(pollStatus, STATUS_EVERY);
}

function renderStatus(st) {
  access = st.access;
  const badge = $("access");
  badge.hidden = false;
  badge.textContent = access === "admin" ? "admin" : "read-only";
  badge.className = "badge" + (access === "admin" ? "" : " read");
  for (const b of document.querySelectorAll("button.act")) b.disabled = access !== "admin";

  setState(st.state, st.state, st.summary);
  const relay = st.relay || {};
  setText("mode", st.mode);
  setText("mode-sub", "this relay: " + (relay.mode ? relay.mode + (relay.leader ? ", leader" : "") : "standing by"));
  if (st.leader) {
    setText("leader", "pid " + st.leader.pid);
    setText("leader-sub", (st.leader.application_name || "") + (st.leader.client_addr ? " from " + st.leader.client_addr : "") +
      (st.leader.by === "lock" ? " (leader lock)" : " (streams the slot)"));
  } else {
    setText("leader", "none");
    setText("leader-sub", "no relay leads the slot");
  }
  const slot = st.slot || {};
  if (slot.exists) {
    setText("lag", bytes(slot.lag_bytes));
    setText("lag-sub", "retains " + bytes(slot.retained_wal_bytes) + " · " + (slot.wal_status || "") +
      (st.checkpoint ? " · checkpoint " + ago(st.checkpoint.updated_at) : ""));
  } else {
    setText("lag", "no slot");
    setText("lag-sub", "slot " + slot.name + " does not exist");
  }
  let rate = 0;
  for (const s of st.sinks || []) rate += s.last_minute.rate_per_second;
  setText("rate", num(rate, rate < 10 ? 1 : 0));
  setText("rate-sub", "all sinks, last minute");
  setText("oldest", st.oldest_pending_seconds ? seconds(st.oldest_pending_seconds) : "none");
  setText("oldest-sub", relay.rows_counted ? "from the table gauges (every 10 s)" : "counting…");

  sinks = (st.sinks || []).map((s) => s.name);
  renderSinks(st);
  renderRows(st);
  renderErrors(st.errors || []);
  fillSinkSelects();
  const dead = (st.rows.failed || 0) + (st.rows.held || 0);
  setText("dlq-count", dead > 0 ? num(dead) : "");
}

function renderSinks(st) {
  const tbody = $("sinks").tBodies[0];
  tbody.replaceChildren();
  (st.sinks || []).forEach((s, i) => {
    const m = s.last_minute;
    tbody.append(el("tr", {},
      el("td", {}, el("span", { class: "swatch c" + (i % 5) }), s.name),
      el("td", { class: "num", text: num(m.rate_per_second, m.rate_per_second < 10 ? 1 : 0) }),
      el("td", { class: "num", text: seconds(m.latency_p50_seconds) }),
      el("td", { class: "num", text: seconds(m.latency_p99_seconds) }),
      el("td", { class: "num", text: num(s.since_start.delivered) }),
      el("td", { class: "num", text: num(s.since_start.failed) }),
      el("td", { class: "num", text: num(s.since_start.retried) }),
      el("td", { class: s.paused ? "paused" : "", id: "sink-state-" + s.name,
        title: s.paused ? "paused " + time(s.paused.paused_at) + (s.paused.reason ? ": " + s.paused.reason : "") : "",
        text: s.paused ? "paused" : "delivering" }),
      el("td", { class: "num", id: "sink-limit-" + s.name,
        title: s.rate_limit_per_second ? "waited " + seconds(s.since_start.rate_limit_wait_seconds) + " on the limit since start" : "no rate limit",
        text: s.rate_limit_per_second ? num(s.rate_limit_per_second) + "/s · waited " + seconds(s.last_minute.rate_limit_wait_seconds) : "—" }),
      el("td", { class: "actions" }, pauseButton(s)),
    ));
  });
  const legend = $("legend");
  legend.replaceChildren(...(st.sinks || []).map((s, i) => el("span", {}, el("span", { class: "swatch c" + (i % 5) }), s.name)));
  drawChart($("chart-rate"), st.chart.times, sinks.map((n) => st.chart.rate[n] || []), (v) => num(v, v < 10 ? 1 : 0) + "/s");
  drawChart($("chart-p99"), st.chart.times, sinks.map((n) => (st.chart.p99[n] || []).map((v) => v === null ? null : v)), seconds);
}

// pauseButton pauses or resumes sink s (docs/operations.md, "Pause and
// resume a sink"): the same code as outbox-relay sink pause|resume.
function pauseButton(s) {
  const action = s.paused ? "resume" : "pause";
  const button = el("button", { class: "act", id: action + "-" + s.name, text: s.paused ? "Resume" : "Pause" });
  button.disabled = access !== "admin";
  button.addEventListener("click", async () => {
    button.disabled = true;
    const res = await api("sinks/" + encodeURIComponent(s.name) + "/" + action, { method: "POST" });
    const note = $("sinks-result");
    note.className = "note " + (res.ok ? "ok" : "bad");
    note.textContent = res.ok ? res.body.message : res.body.error;
    pollStatus();
  });
  return button;
}

// drawChart draws one line per series over times, with the top value and
// the span as labels; a null value breaks the line.
function drawChart(svg, times, series, label) {
  const NS = "http://www.w3.org/2000/svg";
  const w = svg.clientWidth || 400, h = svg.clientHeight || 130;
  const padL = 8, padR = 8, padT = 16, padB = 16;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
    return e;
  };
  let top = 0;
  for (const s of series) for (const v of s) if (v !== null && v > top) top = v;
  // The last 15 minutes, or less while the relay has not run that long
  // (at least 2), so that a young relay's flow is not a sliver.
  const end = times.length ? times[times.length - 1] : Date.now() / 1000;
  const span = Math.min(15 * 60, Math.max(120, times.length ? end - times[0] : 0));
  const x = (t) => padL + (w - padL - padR) * (1 - (end - t) / span);
  const y = (v) => padT + (h - padT - padB) * (1 - (top > 0 ? v / top : 0));
  for (const f of [0, 0.5, 1]) add("line", { class: "grid-line", x1: padL, x2: w - padR, y1: padT + (h - padT - padB) * f, y2: padT + (h - padT - padB) * f });
  add("text", { class: "axis", x: padL, y: 11 }, top > 0 ? "max " + label(top) : "no data yet");
  add("text", { class: "axis", x: padL, y: h - 4 }, Math.round(span / 60) + " min ago");
  add("text", { class: "axis", x: w - padR, y: h - 4, "text-anchor": "end" }, "now");
  series.forEach((values, i) => {
    let d = "";
    let pen = false;
    let last = null;
    values.forEach((v, j) => {
      const t = times[j];
      if (v === null || v === undefined || end - t > span) { pen = false; return; }
      d += (pen ? "L" : "M") + x(t).toFixed(1) + " " + y(v).toFixed(1) + " ";
      pen = true;
      last = [x(t), y(v)];
    });
    if (d) add("path", { class: "series c" + (i % 5), d });
    if (last) add("circle", { class: "point c" + (i % 5), cx: last[0].toFixed(1), cy: last[1].toFixed(1), r: 2.5 });
  });
}

function renderRows(st) {
  const dl = $("rows");
  dl.replaceChildren();
  for (const status of ["pending", "processing", "held", "failed", "done"]) {
    const n = st.rows[status] || 0;
    dl.append(el("dt", { text: status === "done" ? "done (estimate)" : status }), el("dd", { class: (status === "failed" || status === "held") && n > 0 ? "bad" : "", text: num(n) }));
  }
  setText("rows-note", st.relay && st.relay.rows_counted ? "the relay's table gauges, every 10 s" : "not counted yet");
}

function renderErrors(errors) {
  const ul = $("errors");
  if (errors.length === 0) {
    ul.replaceChildren(el("li", { class: "ok", text: "Nothing: no errors, no dead letters, no failures in the last minute." }));
    return;
  }
  ul.replaceChildren(...errors.map((e) => el("li", { text: e })));
}

function fillSinkSelects() {
  for (const select of document.querySelectorAll("select.sink-select")) {
    const have = Array.from(select.options).slice(1).map((o) => o.value).join(",");
    if (have === sinks.join(",")) continue;
    const keep = select.value;
    while (select.options.length > 1) select.remove(1);
    for (const s of sinks) select.append(el("option", { value: s, text: s }));
    select.value = sinks.includes(keep) ? keep : "";
  }
}

// --- the live feed ----------------------------------------------------------

// startFeed reads the server-sent events of ../api/v1/feed with fetch, so
// that the token travels in a header (EventSource cannot send one), and
// reconnects after a pause when the stream ends.
async function startFeed() {
  if (feedAbort) feedAbort.abort();
  const abort = new AbortController();
  feedAbort = abort;
  while (token && feedAbort === abort) {
    setText("feed-state", "connecting…");
    try {
      const res = await fetch(API + "feed", { headers: { Authorization: "Bearer " + token }, signal: abort.signal, cache: "no-store", credentials: "omit" });
      if (res.status === 401) { signOut("The token was refused."); return; }
      if (!res.ok) {
        let msg = res.status + " " + res.statusText;
        try { msg = (await res.json()).error || msg; } catch (e) { /* not JSON */ }
        setText("feed-state", "feed unavailable: " + msg);
      } else {
        setText("feed-state", "live");
        const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            feedEvent(buffer.slice(0, cut));
            buffer = buffer.slice(cut + 2);
          }
        }
        setText("feed-state", "disconnected");
      }
    } catch (e) {
      if (abort.signal.aborted) return;
      setText("feed-state", "disconnected: " + e.message);
    }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

function feedEvent(block) {
  let type = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event: ")) type = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  if (type === "dropped") {
    feedDropped = JSON.parse(data).dropped;
  } else if (type === "delivery") {
    feedSeen++;
    if (!feedPaused) addFeedRow(JSON.parse(data));
  }
  setText("feed-counts", num(feedSeen) + " outcomes" + (feedDropped ? ", " + num(feedDropped) + " dropped (the page fell behind)" : ""));
}

function addFeedRow(d) {
  const tbody = $("feed").tBodies[0];
  const row = el("tr", { class: "fresh" },
    el("td", { class: "mono", text: time(d.at) }),
    el("td", { text: d.sink }),
    el("td", {}, el("span", { class: "outcome " + d.outcome, text: d.outcome })),
    el("td", { class: "type", text: d.event_type === null ? "(null)" : d.event_type }),
    el("td", { class: "key", text: d.event_key }),
    el("td", { class: "num", text: String(d.id) }),
    el("td", { class: "num", text: d.outcome === "delivered" ? seconds(d.latency_seconds) : "" }),
    el("td", { class: "reason", text: d.reason || (d.payload ? d.payload : "") }),
  );
  tbody.prepend(row);
  while (tbody.rows.length > FEED_ROWS) tbody.deleteRow(tbody.rows.length - 1);
  $("feed-empty").hidden = true;
  $("feed").hidden = false;
}

// --- dead letters -----------------------------------------------------------

function dlqQuery(after) {
  const form = $("dlq-filter");
  const q = new URLSearchParams();
  for (const name of ["status", "sink", "type"]) {
    const v = form.elements[name].value.trim();
    if (v) q.set(name, v);
  }
  if (after) q.set("after", after);
  return "dead-letters?" + q.toString();
}

async function loadDeadLetters(more) {
  const res = await api(dlqQuery(more ? dlqAfter : null));
  const note = $("dlq-result");
  if (!res.ok) { note.className = "note bad"; note.textContent = res.body.error; return; }
  const tbody = $("dlq").tBodies[0];
  if (!more) { tbody.replaceChildren(); dlqShown = []; }
  dlqPaged = more;
  for (const e of res.body.events) {
    dlqShown.push(e.id);
    tbody.append(deadLetterRow(e));
  }
  dlqAfter = res.body.next_after || null;
  $("dlq-more").hidden = !res.body.more;
  $("dlq-empty").hidden = dlqShown.length > 0;
  $("dlq").hidden = dlqShown.length === 0;
}

function deadLetterRow(e) {
  const states = el("td", {});
  for (const l of e.ledger) states.append(el("span", { class: "ledger-state" }, el("b", { text: l.sink }), " " + l.state));
  if (e.ledger.length === 0) states.append(el("span", { class: "muted", text: "no ledger rows" }));
  const retry = el("button", { type: "button", class: "act small", text: "Retry", "data-id": e.id, onclick: () => change("retry", { ids: [e.id] }) });
  const discard = armed(el("button", { type: "button", class: "act danger small", text: "Discard", "data-id": e.id }), "Confirm", () => change("discard", { ids: [e.id] }));
  retry.disabled = discard.disabled = access !== "admin";
  const err = e.last_error || "";
  return el("tr", { "data-id": e.id },
    el("td", { class: "num", text: String(e.id) }),
    el("td", {}, el("span", { class: "outcome " + e.status, text: e.status })),
    el("td", { class: "type", text: e.event_type === null ? "(null)" : e.event_type }),
    el("td", { class: "key", text: e.event_key }),
    el("td", { class: "num", text: String(e.attempts) }),
    states,
    el("td", { class: "err", title: err, text: err.length > 240 ? err.slice(0, 239) + "…" : err }),
    el("td", { class: "actions" }, retry, " ", discard),
  );
}

// armed makes button act on a second click within 4 s: the first shows
// confirmText.
function armed(button, confirmText, act) {
  const label = button.textContent;
  let timer = null;
  button.addEventListener("click", () => {
    if (button.classList.contains("armed")) {
      clearTimeout(timer);
      button.classList.remove("armed");
      button.textContent = label;
      act();
      return;
    }
    button.classList.add("armed");
    button.textContent = confirmText;
    timer = setTimeout(() => { button.classList.remove("armed"); button.textContent = label; }, 4000);
  });
  return button;
}

async function change(action, body) {
  const path = action === "replay" ? "replay" : "dead-letters/" + action;
  const res = await api(path, { method: "POST", body });
  const note = $(action === "replay" ? "replay-result" : "dlq-result");
  note.className = "note " + (res.ok ? "ok" : "bad");
  note.textContent = res.ok ? res.body.message : res.body.error;
  if (action !== "replay") loadDeadLetters(false);
  pollStatus();
  return res;
}

// --- event lookup -----------------------------------------------------------

async function lookup(ref) {
  ref = ref.trim();
  const path = /^#\d+$/.test(ref) ? "events?id=" + ref.slice(1) : "events/" + encodeURIComponent(ref);
  const res = await api(path);
  const out = $("lookup-result");
  out.replaceChildren();
  const note = $("lookup-error");
  if (!res.ok) { note.className = "note bad"; note.textContent = res.body.error; return; }
  note.textContent = "";
  const r = res.body;
  const fields = el("dl", {});
  const add = (k, v) => fields.append(el("dt", { text: k }), el("dd", { text: v === null || v === undefined || v === "" ? "–" : String(v) }));
  add("id", r.id); add("event key", r.event_key); add("type", r.event_type); add("aggregate", (r.aggregate_type || "–") + " / " + (r.aggregate_id || "–"));
  add("state", r.state); add("status", r.status); add("attempts", r.attempts); add("replays", r.replays);
  add("created", r.created_at); add("available", r.available_at); add("processed", r.processed_at);
  add("payload", r.payload_bytes === null ? "NULL" : num(r.payload_bytes) + " bytes (not shown)");
  if (r.waits_behind) add("waits behind", "#" + r.waits_behind.id + " " + r.waits_behind.event_key + " (" + r.waits_behind.status + ")");
  add("last error", r.last_error);
  const table = el("table", { class: "data" },
    el("thead", {}, el("tr", {}, ...["Sink", "Routed", "Delivered", "Ledger", "Attempts", "Detail"].map((h) => el("th", { text: h })))));
  const tbody = el("tbody");
  for (const s of r.sinks || []) {
    tbody.append(el("tr", {},
      el("td", { text: s.name + (s.configured ? "" : " (not configured)") }),
      el("td", { text: s.routed ? "yes" : "no" }),
      el("td", { text: s.delivered ? "yes" : "no" }),
      el("td", { text: s.ledger ? s.ledger.state : "–" }),
      el("td", { class: "num", text: s.ledger ? String(s.ledger.attempts) : "" }),
      el("td", { class: "err", text: s.ledger && s.ledger.detail ? s.ledger.detail : "" })));
  }
  table.append(tbody);
  out.append(el("div", { class: "report" }, fields, el("div", {}, el("h2", { text: "Sinks" }), table)));
}

// --- replay -----------------------------------------------------------------

function replayBody(dryRun) {
  const f = $("replay-form").elements;
  const body = { dry_run: dryRun };
  if (f.since.value.trim()) body.since = f.since.value.trim();
  const ids = f.ids.value.split(/[\s,]+/).filter(Boolean).map(Number);
  if (ids.length) body.ids = ids;
  if (f.event_type.value.trim()) body.event_type = f.event_type.value.trim();
  if (f.sink.value) body.sink = f.sink.value;
  return body;
}

// --- wiring -----------------------------------------------------------------

function showTab(name) {
  activeTab = name;
  for (const b of document.querySelectorAll(".tabs button")) b.setAttribute("aria-selected", String(b.dataset.tab === name));
  for (const t of document.querySelectorAll(".tab")) t.hidden = t.id !== "tab-" + name;
  if (name === "dlq") loadDeadLetters(false);
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (e) => { e.preventDefault(); signIn($("token").value); $("token").value = ""; });
  $("signout").addEventListener("click", () => signOut(""));
  for (const b of document.querySelectorAll(".tabs button")) b.addEventListener("click", () => showTab(b.dataset.tab));
  $("feed-pause").addEventListener("click", () => {
    feedPaused = !feedPaused;
    $("feed-pause").textContent = feedPaused ? "Resume" : "Pause";
  });
  $("dlq-filter").addEventListener("submit", (e) => { e.preventDefault(); loadDeadLetters(false); });
  $("dlq-more").addEventListener("click", () => loadDeadLetters(true));
  $("dlq-retry-all").addEventListener("click", () => { if (dlqShown.length) change("retry", { ids: dlqShown.slice() }); });
  armed($("dlq-discard-all"), "Confirm discard", () => { if (dlqShown.length) change("discard", { ids: dlqShown.slice() }); });
  $("lookup-form").addEventListener("submit", (e) => { e.preventDefault(); lookup(e.target.elements.ref.value); });
  $("replay-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    $("replay-go").hidden = true;
    const res = await change("replay", replayBody(true));
    if (res.ok && res.body.selected > 0) {
      $("replay-go").hidden = false;
      $("replay-go").textContent = "Replay " + num(res.body.selected) + " events";
    }
  });
  $("replay-go").addEventListener("click", async () => {
    $("replay-go").hidden = true;
    await change("replay", replayBody(false));
  });
  // The dead letters refresh while shown, unless the operator paged on.
  setInterval(() => { if (token && activeTab === "dlq" && !dlqPaged) loadDeadLetters(false); }, 10000);

  if (token) signIn(token);
  else signOut("");
});
