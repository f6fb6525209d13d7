"""`GET /`: a self-contained HTML status page for one run.

The page is static HTML plus a small script that fetches ``/v1/runs/{run}/status`` every two
seconds and redraws: the run header, the open round's progress towards its deadline, the peer
table (state, last loss, bandwidth, lag, flags, why dropped), an inline SVG plot of mean loss and
round time per round, and the latest rounds with the packets peers refused and why. Nothing is loaded from elsewhere (no CDN, no fonts):
a coordinator often runs where the browser has no internet, and the page must not leak who
watches it. With no run given, the script picks the newest run from ``/v1/runs``.
"""

from __future__ import annotations

import json

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>locoswarm coordinator</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2330; }
header { background: #1d2330; color: #fff; padding: 12px 24px; display: flex; gap: 24px;
         align-items: baseline; }
header h1 { font-size: 18px; margin: 0; }
main { padding: 16px 24px; display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
section { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; padding: 12px 16px; }
section.wide { grid-column: 1 / 3; }
h2 { font-size: 14px; margin: 0 0 8px; color: #4a5568; text-transform: uppercase; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #eef0f4; }
th { color: #6b7280; font-weight: 600; }
.bar { height: 14px; background: #e5e7eb; border-radius: 7px; overflow: hidden; }
.bar > div { height: 100%; background: #3b82f6; }
.live { color: #15803d; } .gone { color: #b91c1c; } .left { color: #6b7280; }
.flag { color: #b45309; font-weight: 600; }
.muted { color: #6b7280; }
#error { color: #b91c1c; }
</style></head>
<body>
<header><h1>locoswarm</h1><span id="run-title">loading...</span>
<span id="run-state" class="muted"></span><span id="error"></span></header>
<main>
<section><h2>Round</h2><div id="round-info" class="muted">no round yet</div>
<div class="bar"><div id="round-bar" style="width:0%"></div></div>
<div id="deadline-info" class="muted"></div></section>
<section><h2>Run</h2><div id="run-info" class="muted"></div></section>
<section class="wide"><h2>Loss and round time per round</h2>
<svg id="plot" width="100%" height="260" viewBox="0 0 1200 260" preserveAspectRatio="none"
     role="img" aria-label="loss and round time per round"></svg>
<div class="muted"><span style="color:#2563eb">&#9632; mean train loss</span> &nbsp;
<span style="color:#ea580c">&#9632; round time (s)</span></div></section>
<section class="wide"><h2>Peers</h2><table id="peers"><thead><tr>
<th>peer</th><th>#</th><th>state</th><th>activity</th><th>device</th><th>last loss</th>
<th>bandwidth</th><th>lag</th><th>flags / reason</th></tr></thead><tbody></tbody></table>
</section>
<section class="wide"><h2>Recent rounds</h2><table id="history"><thead><tr>
<th>round</th><th>contributors</th><th>mean loss</th><th>round time</th><th>applied</th>
<th>majority digest</th><th>refused packets</th></tr></thead><tbody></tbody></table></section>
</main>
<script>
"use strict";
let runId = __RUN_ID__;
const REFRESH_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";

function text(v, digits) {
  if (v === null || v === undefined) return "-";
  return typeof v === "number" && digits !== undefined ? v.toFixed(digits) : String(v);
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
}
function svg(tag, attrs) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function drawSeries(plot, xs, ys, box, color, label, side) {
  const points = xs.map((x, i) => [x, ys[i]]).filter(p => p[1] !== null);
  if (!points.length) return;
  let lo = Math.min(...points.map(p => p[1])), hi = Math.max(...points.map(p => p[1]));
  if (hi - lo < 1e-9) { lo -= 1; hi += 1; }
  const x0 = xs[0], x1 = Math.max(xs[xs.length - 1], x0 + 1);
  const px = x => box.left + (x - x0) / (x1 - x0) * (box.right - box.left);
  const py = y => box.bottom - (y - lo) / (hi - lo) * (box.bottom - box.top);
  const d = points.map((p, i) => (i ? "L" : "M") + px(p[0]).toFixed(1) + " "
                                 + py(p[1]).toFixed(1)).join(" ");
  plot.appendChild(svg("path", {d: d, fill: "none", stroke: color, "stroke-width": 2.5,
                                class: "series-" + label}));
  for (const p of points) {
    plot.appendChild(svg("circle", {cx: px(p[0]), cy: py(p[1]), r: 3, fill: color}));
  }
  const ax = side === "left" ? box.left - 6 : box.right + 6;
  for (const [v, y] of [[hi, box.top], [lo, box.bottom]]) {
    const t = svg("text", {x: ax, y: y + 4, fill: color, "font-size": 12,
                           "text-anchor": side === "left" ? "end" : "start"});
    t.textContent = v.toPrecision(4);
    plot.appendChild(t);
  }
}

function drawPlot(history) {
  const plot = document.getElementById("plot");
  while (plot.firstChild) plot.removeChild(plot.firstChild);
  const box = {left: 70, right: 1130, top: 14, bottom: 230};
  plot.appendChild(svg("rect", {x: box.left, y: box.top, width: box.right - box.left,
                                height: box.bottom - box.top, fill: "#fbfcfd",
                                stroke: "#dde1e8"}));
  if (!history.length) {
    const t = svg("text", {x: 600, y: 130, "text-anchor": "middle", fill: "#6b7280"});
    t.textContent = "no closed rounds yet";
    plot.appendChild(t);
    return;
  }
  const xs = history.map(h => h.round);
  drawSeries(plot, xs, history.map(h => h.mean_loss), box, "#2563eb", "loss", "left");
  drawSeries(plot, xs, history.map(h => h.round_time_s), box, "#ea580c", "time", "right");
  for (const [x, anchor, v] of [[box.left, "start", xs[0]],
                                [box.right, "end", xs[xs.length - 1]]]) {
    const t = svg("text", {x: x, y: box.bottom + 18, "font-size": 12, "text-anchor": anchor,
                           fill: "#4a5568"});
    t.textContent = "round " + v;
    plot.appendChild(t);
  }
}

function render(s) {
  const run = s.run;
  document.getElementById("run-title").textContent = run.name + " (" + run.run_id + ")";
  document.getElementById("run-state").textContent = run.state;
  const c = run.config;
  document.getElementById("run-info").textContent =
    c.model.preset + " / " + c.outer.strategy + " / H=" + c.inner.steps + " / top-k " + c.outer.top_k +
    " / deadline " + (c.deadline.kind === "fixed" ? c.deadline.round_timeout_s + " s"
      : "adaptive (q" + c.deadline.quantile + " x" + c.deadline.margin + ")") +
    (c.outer.overlap ? " / overlap" : "") + " / min peers " + c.membership.min_peers;
  const cur = s.current_round;
  const bar = document.getElementById("round-bar");
  if (cur) {
    document.getElementById("round-info").textContent = "round " + cur.round + " " +
      cur.state + ": " + cur.num_submitted + " of " + cur.num_expected + " submitted";
    bar.style.width = (cur.num_expected ? 100 * cur.num_submitted / cur.num_expected : 0) + "%";
    document.getElementById("deadline-info").textContent = cur.deadline === null ?
      "waiting for peers" : "deadline in " + Math.max(0, cur.deadline - s.now).toFixed(0) + " s";
  } else {
    document.getElementById("round-info").textContent = "run " + run.state;
    bar.style.width = "100%";
    document.getElementById("deadline-info").textContent = "";
  }
  const peers = document.querySelector("#peers tbody");
  peers.textContent = "";
  for (const p of s.peers) {
    const row = document.createElement("tr");
    row.className = "peer-row";
    cell(row, p.peer_id); cell(row, p.peer_index); cell(row, p.status, p.status);
    cell(row, p.activity); cell(row, p.device); cell(row, text(p.last_loss, 4));
    cell(row, bandwidth(p.bandwidth_mbps, p.uplink_mbps));
    cell(row, text(p.lag_rounds));
    const note = p.flags.map(f => f + (p.mismatch_round !== null ? " @" + p.mismatch_round : ""));
    if (p.reason) note.push(p.reason);
    cell(row, note.join("; "), p.flags.length ? "flag" : "muted");
    peers.appendChild(row);
  }
  drawPlot(s.history);
  const hist = document.querySelector("#history tbody");
  hist.textContent = "";
  for (const h of s.history.slice(-15).reverse()) {
    const row = document.createElement("tr");
    row.className = "round-row";
    cell(row, h.round); cell(row, h.num_contributors); cell(row, text(h.mean_loss, 4));
    cell(row, h.round_time_s.toFixed(h.round_time_s < 10 ? 2 : 1) + " s"); cell(row, h.num_applied);
    cell(row, h.majority_digest ? h.majority_digest.slice(0, 16) : "-");
    const refused = Object.entries(h.refused || {}).map(([p, why]) => p + ": " + why);
    cell(row, refused.length ? refused.join("; ") : "-", refused.length ? "flag" : "muted");
    hist.appendChild(row);
  }
}

async function refresh() {
  try {
    if (runId === null) {
      const runs = (await (await fetch("/v1/runs")).json()).runs;
      if (!runs.length) {
        document.getElementById("run-title").textContent = "no runs yet";
        return;
      }
      runId = runs[runs.length - 1].run_id;
    }
    const response = await fetch("/v1/runs/" + encodeURIComponent(runId) + "/status");
    if (!response.ok) throw new Error((await response.json()).detail || response.status);
    render(await response.json());
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = "refresh failed: " + e.message;
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body></html>
"""


def render_page(run_id: str | None) -> str:
    """The page for `run_id`, or for whatever run is newest when the script runs."""
    # json.dumps gives a JS string literal; escaping '<' keeps '</script>' out of the page.
    literal = json.dumps(run_id).replace("<", "\\u003c") if run_id else "null"
    return _PAGE.replace("__RUN_ID__", literal)
