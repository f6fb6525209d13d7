"""`GET /`: a self-contained HTML status page for one run.

The page is static HTML plus a small script that fetches ``/v1/runs`` and
``/v1/runs/{run}/status`` every two seconds and redraws: a run picker (every run, by name and
state; choosing one loads ``/?run=ID``), a banner when the run waits for peers or its open round
is stalled, the open round's bar (the live peers' inner steps, then the submissions, then the
close), the peer table (state, activity with its inner step, last loss, bandwidth, lag, flags,
why dropped, standing unless a contributor, contribution score and exclusion), two small SVG plots sharing an x axis of rounds (the peers' mean train loss with
the validation loss of the model after the round, joined across the rounds between evaluations;
round time in seconds), and the latest rounds with their losses, tokens, packet bytes, how many
times smaller the packets were than the updates sent dense, the agreed digest (or the provisional
majority, marked so), and the packets peers refused; a bounded round shows how many submissions
its manifest picked, with why the others were left out on hover.
Nothing is loaded from elsewhere (no CDN, no fonts): a coordinator often runs where the browser
has no internet, and the page must not leak who watches it. With no run given, the server picks
the newest run still waiting or running, else the newest (`coordinator.views.Views.latest_run_id`).

Stalled: the open round is past its deadline, or nothing moved (no submission, no peer's inner
step) for ``membership.heartbeat_timeout_s`` -- four heartbeats of every peer. Since the status
carries no time of the last progress, the script measures it from the round's opening when no
progress shows at all, else from when it saw the progress change.
"""

from __future__ import annotations

import json

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>locoswarm coordinator</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2330; }
header { background: #1d2330; color: #fff; padding: 10px 24px; display: flex; gap: 20px;
         align-items: center; flex-wrap: wrap; }
header h1 { font-size: 18px; margin: 0; }
header select { font: inherit; max-width: 420px; }
main { padding: 16px 24px; display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
section { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; padding: 12px 16px; }
section.wide { grid-column: 1 / 3; }
h2 { font-size: 14px; margin: 0 0 8px; color: #4a5568; text-transform: uppercase; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #eef0f4; }
th { color: #6b7280; font-weight: 600; }
.banner { grid-column: 1 / 3; padding: 10px 16px; border-radius: 6px; font-weight: 600; }
.banner.stalled { background: #fef3c7; border: 1px solid #f59e0b; color: #92400e; }
.banner.waiting { background: #e0ecff; border: 1px solid #60a5fa; color: #1e3a8a; }
.phases { display: grid; grid-template-columns: 2fr 1fr 1fr; gap: 6px; margin: 6px 0; }
.phase-label { font-size: 12px; color: #4a5568; }
.bar { height: 14px; background: #e5e7eb; border-radius: 7px; overflow: hidden; }
.bar > div { height: 100%; width: 0%; }
#bar-train { background: #3b82f6; } #bar-submit { background: #16a34a; } #bar-close { background: #6b7280; }
.live { color: #15803d; } .gone { color: #b91c1c; } .left { color: #6b7280; }
.flag { color: #b45309; font-weight: 600; }
.muted { color: #6b7280; }
#sample { white-space: pre-wrap; margin: 0.4em 0 0; font-size: 0.9em; }
.plot { display: block; width: 100%; height: 150px; }
.plot.bottom { height: 180px; }
#error { color: #fca5a5; }
</style></head>
<body>
<header><h1>locoswarm</h1>
<label class="muted" for="run-picker">run</label>
<select id="run-picker" aria-label="run"></select>
<span id="run-title">loading...</span>
<span id="run-state" class="muted"></span><span id="error"></span></header>
<main>
<div id="banner" class="banner" hidden></div>
<section><h2>Round</h2><div id="round-info" class="muted">no round yet</div>
<div class="phases">
<div><div class="phase-label">training <span id="train-pct"></span></div>
<div class="bar"><div id="bar-train"></div></div></div>
<div><div class="phase-label">submitted <span id="submit-count"></span></div>
<div class="bar"><div id="bar-submit"></div></div></div>
<div><div class="phase-label">closed</div><div class="bar"><div id="bar-close"></div></div></div>
</div>
<div id="deadline-info" class="muted"></div></section>
<section><h2>Run</h2><div id="run-info" class="muted"></div></section>
<section class="wide"><h2>Loss and round time per round</h2>
<svg id="plot-loss" class="plot" role="img" aria-label="mean train loss per round"></svg>
<svg id="plot-time" class="plot bottom" role="img" aria-label="round time in seconds per round"></svg>
</section>
<section class="wide"><h2>What the model writes</h2><div id="sample-info" class="muted">no sample yet</div>
<pre id="sample"></pre></section>
<section class="wide"><h2>Peers</h2><table id="peers"><thead><tr>
<th>peer</th><th>#</th><th>state</th><th>activity</th><th>device</th><th>last loss</th>
<th>bandwidth</th><th>lag</th><th>score</th><th>credit</th><th>flags / reason</th></tr></thead><tbody></tbody></table>
</section>
<section class="wide"><h2>Recent rounds</h2><table id="history"><thead><tr>
<th>round</th><th>contributors</th><th>mean loss</th><th>val loss</th><th>round time</th><th>tokens</th>
<th>packet bytes</th><th>vs dense</th><th>applied</th><th>agreed digest</th><th>disputes, refused packets</th></tr></thead>
<tbody></tbody></table></section>
</main>
<script>
"use strict";
let runId = __RUN_ID__;
const REFRESH_MS = 2000;
const DEADLINE_SLACK_S = 5;  // the coordinator closes a round within a tick of its deadline
const MANY_POINTS = 60;  // above this, the plots draw lines without a marker per round
const SVG_NS = "http://www.w3.org/2000/svg";
const progress = {key: null, since: null};  // the open round's progress, and since when it stood still
let runsKey = null;

function text(v, digits) {
  if (v === null || v === undefined) return "-";
  return typeof v === "number" && digits !== undefined ? v.toFixed(digits) : String(v);
}
function scaled(v, units) {
  // 1234567 -> "1.23 M": powers of 1000, three significant digits.
  if (v === null || v === undefined) return "-";
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return (i ? v.toPrecision(3) : String(Math.round(v))) + (units[i] ? " " + units[i] : "");
}
function ratio(v) {
  // How many times smaller than dense: "84x", "7.5x".
  if (v === null || v === undefined) return "-";
  return (v < 10 ? v.toFixed(1) : v.toFixed(0)) + "x";
}
function bandwidth(measured, uplink) {
  // Measured on the peer's downloads; the uplink as its operator stated it.
  const parts = [];
  if (measured !== null && measured !== undefined) parts.push(measured.toFixed(0) + " Mbps");
  if (uplink !== null && uplink !== undefined) parts.push("up " + uplink.toFixed(0));
  return parts.length ? parts.join(", ") : "-";
}
function cell(row, value, cls) {
  const td = document.createElement("td");
  td.textContent = value;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}
function svg(tag, attrs, content) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (content !== undefined) el.textContent = content;
  return el;
}
function setBar(id, fraction) {
  document.getElementById(id).style.width = (100 * Math.max(0, Math.min(1, fraction))).toFixed(1) + "%";
}

// -- axes -----------------------------------------------------------------------------------

function niceStep(span, count, integer) {
  // About span / count, rounded to 1, 2 or 5 times a power of ten (a whole number for rounds).
  const raw = span / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw * (1 - 1e-9));
  return integer ? Math.max(1, Math.round(step)) : step;
}
function ticks(lo, hi, step) {
  // [value, label] at each multiple of step from lo to hi, with the decimals the step needs.
  const digits = Math.max(0, Math.min(6, -Math.floor(Math.log10(step) + 1e-9)));
  const out = [];
  for (let i = Math.ceil(lo / step - 1e-9); i * step <= hi + step * 1e-9; i++) {
    out.push([i * step, (i * step).toFixed(digits)]);
  }
  return out;
}
function yRange(values, fromZero) {
  let lo = Math.min(...values), hi = Math.max(...values);
  if (fromZero) lo = Math.min(0, lo);
  if (hi - lo < 1e-9 * Math.max(1, Math.abs(hi))) {  // one value (or all equal): a band around it
    const pad = Math.max(Math.abs(hi) * 0.1, 0.5);
    if (!fromZero || lo < 0) lo -= pad;
    hi += pad;
  }
  return [lo, hi];
}

function drawPanel(plot, rounds, series, opts) {
  // One small plot: y ticks and a unit label on the left, the shared x range of rounds, a line
  // per series ({name, label, ys, color, join}: `join` links points across rounds without a
  // value, for a series sparse by design), and a legend when there is more than one.
  while (plot.firstChild) plot.removeChild(plot.firstChild);
  const width = plot.clientWidth || 1100, height = plot.clientHeight || 150;
  plot.setAttribute("viewBox", "0 0 " + width + " " + height);
  const box = {left: 74, right: width - 16, top: 8, bottom: height - (opts.xAxis ? 40 : 12)};
  plot.appendChild(svg("rect", {x: box.left, y: box.top, width: box.right - box.left,
                                height: box.bottom - box.top, fill: "#fbfcfd", stroke: "#dde1e8"}));
  plot.appendChild(svg("text", {x: 14, y: (box.top + box.bottom) / 2, "font-size": 12, fill: series[0].color,
                                "text-anchor": "middle", class: "axis-label",
                                transform: "rotate(-90 14 " + (box.top + box.bottom) / 2 + ")"}, opts.unit));
  const [x0, x1] = opts.xRange;
  const px = x => box.left + (x - x0) / (x1 - x0) * (box.right - box.left);
  const xStep = niceStep(x1 - x0, Math.max(2, Math.floor((box.right - box.left) / 90)), true);
  for (const [v, label] of ticks(x0, x1, xStep)) {
    plot.appendChild(svg("line", {x1: px(v), x2: px(v), y1: box.top, y2: box.bottom, stroke: "#eef0f4"}));
    if (opts.xAxis) {
      plot.appendChild(svg("line", {x1: px(v), x2: px(v), y1: box.bottom, y2: box.bottom + 4, stroke: "#9ca3af"}));
      plot.appendChild(svg("text", {x: px(v), y: box.bottom + 16, "font-size": 11, fill: "#4a5568",
                                    "text-anchor": "middle", class: "x-tick"}, label));
    }
  }
  if (opts.xAxis) {
    plot.appendChild(svg("text", {x: (box.left + box.right) / 2, y: height - 4, "font-size": 12,
                                  fill: "#4a5568", "text-anchor": "middle", class: "axis-label"}, "round"));
  }
  // [round, value, index]: the index tells a gap (a round without the value) from a neighbour.
  const drawn = series.map(s => ({...s, points: rounds.map((r, i) => [r, s.ys[i], i])
                                                      .filter(p => p[1] !== null && p[1] !== undefined)}));
  const values = drawn.flatMap(s => s.points.map(p => p[1]));
  if (!values.length) {
    plot.appendChild(svg("text", {x: (box.left + box.right) / 2, y: (box.top + box.bottom) / 2 + 4,
                                  "text-anchor": "middle", fill: "#6b7280", "font-size": 13},
                         rounds.length ? "no " + opts.unit + " reported" : "no closed rounds yet"));
    return;
  }
  let [lo, hi] = yRange(values, opts.fromZero);
  const yStep = niceStep(hi - lo, Math.max(3, Math.floor((box.bottom - box.top) / 25)), false);
  lo = Math.floor(lo / yStep + 1e-9) * yStep;  // out to the ticks around the data: both ends labelled
  hi = Math.ceil(hi / yStep - 1e-9) * yStep;
  const py = y => box.bottom - (y - lo) / (hi - lo) * (box.bottom - box.top);
  for (const [v, label] of ticks(lo, hi, yStep)) {
    plot.appendChild(svg("line", {x1: box.left, x2: box.right, y1: py(v), y2: py(v), stroke: "#eef0f4"}));
    plot.appendChild(svg("text", {x: box.left - 6, y: py(v) + 4, "font-size": 11, fill: "#4a5568",
                                  "text-anchor": "end", class: "y-tick"}, label));
  }
  for (const s of drawn.filter(s => s.points.length)) {
    let d = "", previous = null;
    for (const p of s.points) {  // a gap breaks the line, unless the series joins across gaps
      d += (previous === null || (!s.join && p[2] !== previous + 1) ? "M" : "L") + px(p[0]).toFixed(1) + " " +
        py(p[1]).toFixed(1) + " ";
      previous = p[2];
    }
    plot.appendChild(svg("path", {d: d.trim(), fill: "none", stroke: s.color, "stroke-width": 2.5,
                                  "stroke-linejoin": "round", class: "series-" + s.name}));
    if (s.points.length <= MANY_POINTS) {
      for (const p of s.points) {
        plot.appendChild(svg("circle", {cx: px(p[0]), cy: py(p[1]), r: s.points.length === 1 ? 5 : 3,
                                        fill: s.color, class: "marker-" + s.name}));
      }
    }
  }
  if (series.length > 1) {  // right-aligned in the top corner, the last series rightmost
    let right = box.right - 8;
    for (const s of series.slice().reverse()) {
      const label = plot.appendChild(svg("text", {x: right, y: box.top + 14, "font-size": 11, fill: "#4a5568",
                                                  "text-anchor": "end", class: "legend"}, s.label));
      right -= (label.getComputedTextLength() || 6 * s.label.length) + 6;
      plot.appendChild(svg("rect", {x: right - 14, y: box.top + 8, width: 14, height: 3, fill: s.color}));
      right -= 28;
    }
  }
}

function drawPlots(history) {
  const rounds = history.map(h => h.round);
  // Half a round of margin each side: a single round sits in the middle of its own tick.
  const xRange = rounds.length ? [rounds[0] - 0.5, rounds[rounds.length - 1] + 0.5] : [-0.5, 0.5];
  drawPanel(document.getElementById("plot-loss"), rounds, [
    {name: "loss", label: "train (mean over peers)", ys: history.map(h => h.mean_loss), color: "#2563eb"},
    // Peers evaluate every few rounds: the points are joined across the rounds in between.
    {name: "val", label: "validation", ys: history.map(h => h.val_loss), color: "#9333ea", join: true},
  ], {unit: "loss", xRange: xRange, xAxis: false, fromZero: false});
  drawPanel(document.getElementById("plot-time"), rounds,
            [{name: "time", label: "round time", ys: history.map(h => h.round_time_s), color: "#ea580c"}],
            {unit: "seconds", xRange: xRange, xAxis: true, fromZero: true});
}

// -- run picker, round bar, banner ------------------------------------------------------------

function pickRun(runs) {
  // As the server does: the newest run still waiting or running, else the newest.
  const live = runs.filter(r => r.state === "waiting" || r.state === "running");
  const candidates = live.length ? live : runs;
  return candidates[candidates.length - 1].run_id;
}
function drawPicker(runs) {
  const key = JSON.stringify(runs.map(r => [r.run_id, r.name, r.state])) + runId;
  if (key === runsKey) return;  // rebuilt only on a change: an open list stays open
  runsKey = key;
  const picker = document.getElementById("run-picker");
  picker.textContent = "";
  for (const r of runs.slice().reverse()) {
    const option = document.createElement("option");
    option.value = r.run_id;
    option.textContent = r.name + " - " + r.state + " (" + r.run_id + ")";
    option.defaultSelected = r.run_id === runId;  // the attribute: what a saved page shows too
    picker.appendChild(option);
  }
}

function trainingFraction(s, steps) {
  // Inner steps of live peers in the open round, each counted up to H (all H once it submitted:
  // its next heartbeat may not have come yet), over H per live peer.
  const live = s.peers.filter(p => p.status === "live");
  if (!live.length) return 0;
  const done = live.reduce((sum, p) => sum + (p.lag_rounds !== 0 ? 0 : p.activity === "submitted" ? steps
                                               : Math.min(p.inner_step || 0, steps)), 0);
  return done / (steps * live.length);
}

function drawRound(s) {
  const run = s.run, cur = s.current_round, steps = run.config.inner.steps;
  const info = document.getElementById("round-info"), deadline = document.getElementById("deadline-info");
  const banner = document.getElementById("banner");
  let warning = null, kind = null;
  if (cur && run.state === "waiting") {
    setBar("bar-train", 0); setBar("bar-submit", 0); setBar("bar-close", 0);
    document.getElementById("train-pct").textContent = "";
    document.getElementById("submit-count").textContent = "";
    info.textContent = "round 0 opens once " + run.config.membership.min_peers + " peers are live";
    deadline.textContent = "";
    kind = "waiting";
    warning = "Waiting for peers: " + cur.num_expected + " of " + run.config.membership.min_peers + " live";
  } else if (cur) {
    const trained = trainingFraction(s, steps);
    setBar("bar-train", trained);
    setBar("bar-submit", cur.num_expected ? cur.num_submitted / cur.num_expected : 0);
    setBar("bar-close", 0);
    document.getElementById("train-pct").textContent = (100 * trained).toFixed(0) + "%";
    document.getElementById("submit-count").textContent = cur.num_submitted + " of " + cur.num_expected;
    info.textContent = "round " + cur.round + " open: " + (100 * trained).toFixed(0) + "% of " +
      steps + " inner steps trained, " + cur.num_submitted + " of " + cur.num_expected + " submitted";
    const left = cur.deadline - s.now;
    deadline.textContent = left >= 0 ? "deadline in " + left.toFixed(0) + " s"
                                     : "deadline passed " + (-left).toFixed(0) + " s ago";
    const done = s.peers.reduce((sum, p) => sum + (p.lag_rounds === 0 && p.inner_step ? p.inner_step : 0), 0);
    const key = run.run_id + "/" + cur.round + "/" + cur.num_submitted + "/" + done;
    if (key !== progress.key) {
      progress.key = key;
      progress.since = cur.num_submitted || done ? s.now : cur.opened_at;
    }
    const still = s.now - progress.since, patience = run.config.membership.heartbeat_timeout_s;
    if (left < -DEADLINE_SLACK_S) {
      kind = "stalled";
      warning = "Round " + cur.round + " stalled: open " + (-left).toFixed(0) + " s past its deadline";
    } else if (still > patience) {
      kind = "stalled";
      warning = "Round " + cur.round + " stalled: no submission and no training progress for " +
        still.toFixed(0) + " s";
    }
  } else {
    setBar("bar-train", 1); setBar("bar-submit", 1); setBar("bar-close", 1);
    document.getElementById("train-pct").textContent = "";
    document.getElementById("submit-count").textContent = "";
    info.textContent = "run " + run.state + " after " + run.current_round + " round" +
      (run.current_round === 1 ? "" : "s");
    deadline.textContent = run.closed_at ? run.state + " at " + new Date(run.closed_at * 1000).toISOString() : "";
  }
  if (s.recovery) {  // paused: every peer stopped; it waits for a peer holding its state
    kind = "stalled";
    warning = "Paused since " + new Date(s.recovery.paused_since * 1000).toISOString().slice(11, 19) +
      " UTC, " + (s.now - s.recovery.paused_since).toFixed(0) + " s: " + s.recovery.message;
  }
  if (s.stuck) {  // live peers catching up on a round whose packets nobody serves (textContent: escaped)
    kind = "stalled";
    warning = (warning ? warning + " | " : "") + s.stuck;
  }
  banner.hidden = warning === null;
  banner.className = kind ? "banner " + kind : "banner";
  banner.textContent = warning || "";
}

// -- tables ---------------------------------------------------------------------------------

function render(s) {
  const run = s.run, c = run.config;
  document.getElementById("run-title").textContent = run.name + " (" + run.run_id + ")";
  document.getElementById("run-state").textContent = run.state;
  document.getElementById("run-info").textContent =
    c.model.preset + " / " + c.outer.strategy + " / H=" + c.inner.steps + " / batch " + c.inner.batch_size +
    " x " + c.inner.seq_len + " / top-k " + c.outer.top_k +
    " / deadline " + (c.deadline.kind === "fixed" ? c.deadline.round_timeout_s + " s"
      : "adaptive (q" + c.deadline.quantile + " x" + c.deadline.margin + ")") +
    (c.outer.overlap ? " / overlap" : "") + " / min peers " + c.membership.min_peers;
  drawRound(s);
  // The newest sample a peer sent with its validation loss: text (textContent), never markup.
  document.getElementById("sample-info").textContent = s.sample
    ? "after round " + s.sample.round + ", from " + s.sample.peer_id : "no sample yet";
  document.getElementById("sample").textContent = s.sample ? s.sample.text : "";
  const peers = document.querySelector("#peers tbody");
  peers.textContent = "";
  for (const p of s.peers) {
    const row = document.createElement("tr");
    row.className = "peer-row";
    cell(row, p.peer_id); cell(row, p.peer_index); cell(row, p.status, p.status);
    const step = p.activity === "training" && p.inner_step !== null && p.inner_step !== undefined;
    cell(row, p.activity + (step ? " " + p.inner_step + "/" + c.inner.steps : ""));
    cell(row, p.device); cell(row, text(p.last_loss, 4));
    cell(row, bandwidth(p.bandwidth_mbps, p.uplink_mbps));
    cell(row, text(p.lag_rounds));
    // Contribution score (protocol/scoring.py): running median loss delta and cosine, hurting rounds.
    const sc = p.score;
    cell(row, sc ? "dloss " + text(sc.loss_delta, 3) + " cos " + text(sc.cosine, 2) +
      (sc.num_hurt ? " (" + sc.num_hurt + "/" + sc.num_rounds + " hurt)" : "") : "-", sc && sc.num_hurt ? "flag" : "muted");
    // Credit (protocol/scoring.py, rule 5): standing earned by useful work, its weight as judge and voter.
    const credit = cell(row, p.credit, p.credit ? "" : "muted");
    credit.title = p.credit_reason || "";
    const note = p.flags.map(f => f + (p.mismatch_round !== null ? " @" + p.mismatch_round : ""));
    if (p.excluded) note.push("excluded: " + p.excluded_reason);
    if (p.reason) note.push(p.reason);
    // Standing (coordinator/rules/standing.py): shown unless it is a contributor the round waits for.
    if (p.standing && p.standing !== "contributor") note.push(p.standing + ": " + (p.standing_reason || ""));
    cell(row, note.join("; "), p.flags.length || p.excluded ? "flag" : "muted");
    peers.appendChild(row);
  }
  drawPlots(s.history);
  const hist = document.querySelector("#history tbody");
  hist.textContent = "";
  for (const h of s.history.slice(-15).reverse()) {
    const row = document.createElement("tr");
    row.className = "round-row";
    cell(row, h.round);
    // A bounded round (outer.max_contributors): picked of submitted, and why the rest were left out.
    const picks = cell(row, h.num_picked === null || h.num_picked === undefined ? h.num_contributors
      : h.num_picked + " of " + h.num_contributors + " picked");
    picks.title = Object.entries(h.not_picked || {}).map(([p, why]) => p + ": " + why).join("\\n");
    cell(row, text(h.mean_loss, 4));
    cell(row, text(h.val_loss, 4));
    cell(row, h.round_time_s.toFixed(h.round_time_s < 10 ? 2 : 1) + " s");
    cell(row, scaled(h.tokens, ["", "k", "M", "G", "T"]));
    cell(row, scaled(h.packet_bytes, ["B", "kB", "MB", "GB", "TB"]));
    cell(row, ratio(h.compression_ratio));
    cell(row, h.num_applied);
    // Only an agreed digest is trusted; a provisional majority is shown as such.
    cell(row, h.agreed_digest ? h.agreed_digest.slice(0, 16)
      : h.majority_digest ? h.majority_digest.slice(0, 16) + " (provisional)" : "-", h.agreed_digest ? "" : "muted");
    const refused = Object.entries(h.refused || {}).map(([p, why]) => p + ": " + why);
    // A dispute (coordinator/disputes.py): the digests the votes named, and what the recomputation found.
    if (h.dispute) refused.unshift("dispute: " + h.dispute.sides.map(d => d.digest.slice(0, 12) + " by " +
      d.peers.length + " (credit " + d.credit + (d.chunks && d.chunks.length ? ", chunks " + d.chunks.join(",") : "") +
      ")").join(" vs ") + "; " + h.dispute.verdict);
    cell(row, refused.length ? refused.join("; ") : "-", refused.length ? "flag" : "muted");
    hist.appendChild(row);
  }
}

async function refresh() {
  try {
    const runs = (await (await fetch("/v1/runs")).json()).runs;
    if (!runs.length) {
      document.getElementById("run-title").textContent = "no runs yet";
      return;
    }
    if (runId === null) runId = pickRun(runs);
    drawPicker(runs);
    const response = await fetch("/v1/runs/" + encodeURIComponent(runId) + "/status");
    if (!response.ok) throw new Error((await response.json()).detail || response.status);
    render(await response.json());
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = "refresh failed: " + e.message;
  }
}
document.getElementById("run-picker").addEventListener("change", e => {
  window.location.search = "?run=" + encodeURIComponent(e.target.value);
});
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body></html>
"""


def render_page(run_id: str | None) -> str:
    """The page for `run_id`, or for the run `coordinator.views.Views.latest_run_id` picks when the script runs."""
    # json.dumps gives a JS string literal; escaping '<' keeps '</script>' out of the page.
    literal = json.dumps(run_id).replace("<", "\\u003c") if run_id else "null"
    return _PAGE.replace("__RUN_ID__", literal)
