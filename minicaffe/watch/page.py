"""The dashboard's page: one self-contained HTML document (its own small SVG plotting
in plain JavaScript; nothing is fetched from outside the server that sent it).

It polls ``api/run?since=V`` (the RunRecord as JSON, or "unchanged") every second while
the run trains, draws
one chart per group (training loss and outputs, test scores, learning rate, images/s,
data-wait share, device memory), the run's facts, its snapshots and the net's drawing
(``net.svg``, when Graphviz could draw it).  Each plotted line carries its points as
``data-series``/``data-values`` attributes ("iteration:value,..."), so what the page
shows can be read back from its DOM.  When the server is gone the page keeps the last
data and says so.  It has no control: nothing on it changes the run.
"""

PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>minicaffe dashboard</title>
<style>
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;background:#f6f7f9;color:#222}
header{background:#26374a;color:#fff;padding:10px 18px;display:flex;gap:18px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}
#status{font-weight:600}
#status.training{color:#8fe08f}#status.failed{color:#ff9b9b}#status.gone{color:#ffd27f}
main{padding:12px 18px;display:grid;grid-template-columns:repeat(auto-fill,minmax(470px,1fr));gap:12px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:8px 10px}
section h2{font-size:14px;margin:0 0 4px 0;color:#26374a}
table{border-collapse:collapse;font-size:13px}td{padding:2px 8px 2px 0;vertical-align:top}
td.k{color:#667}
.na{color:#888;font-size:13px;padding:24px 0;text-align:center}
svg text{font-size:10px;fill:#555}
.legend span{font-size:12px;margin-right:12px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:3px;margin-right:4px;vertical-align:middle}
#net img{max-width:100%}#snapshots,#net-draw{font-size:13px}
.chart svg{width:100%;height:auto}
#bar{height:6px;background:#dde1e6;border-radius:3px;margin-top:4px}#bar div{height:6px;background:#4c8bf5;border-radius:3px;width:0}
</style></head>
<body>
<header><h1>minicaffe: <span id="net-name">run</span></h1>
<span id="status">loading</span><span id="where"></span></header>
<main>
<section id="facts-box"><h2>Run</h2><table id="facts"></table><div id="bar"><div></div></div>
<h2 style="margin-top:8px">Snapshots</h2><div id="snapshots" class="k">none yet</div></section>
<section><h2>Training loss</h2><div class="chart" data-group="train"></div></section>
<section><h2>Test scores</h2><div class="chart" data-group="test"></div></section>
<section><h2>Learning rate</h2><div class="chart" data-group="lr"></div></section>
<section><h2 id="speed-title">Images per second</h2><div class="chart" data-group="speed"></div></section>
<section><h2>Share of the iteration waiting for data</h2><div class="chart" data-group="data_wait"></div></section>
<section><h2>Device memory (MiB, high-water mark)</h2><div class="chart" data-group="memory"></div></section>
<section id="net" style="grid-column:1/-1"><h2>Net</h2><div id="net-draw" class="k">loading</div></section>
</main>
<script>
"use strict";
const TOKEN = new URLSearchParams(location.search).get("token");
const Q = TOKEN ? "?token=" + encodeURIComponent(TOKEN) : "";
const COLORS = ["#1f77b4","#d62728","#2ca02c","#ff7f0e","#9467bd","#8c564b","#e377c2","#17becf"];
const NA = {data_wait: "n/a: this run does not measure its data wait",
            memory: "n/a: no GPU in this run (or not recorded)",
            speed: "n/a: no speed recorded yet", test: "no test yet", train: "no display yet",
            lr: "no display yet"};
function groupOf(name) {
  if (name.startsWith("train/")) return "train";
  if (/^test\d*\//.test(name)) return "test";
  if (name === "lr") return "lr";
  if (name === "speed/images_per_s") return "speed";
  if (name === "data_wait_share") return "data_wait";
  if (name === "device_memory_mib") return "memory";
  return null;
}
function fmt(v) {
  if (v === null || v === undefined) return "n/a";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
  return String(+v.toPrecision(4));
}
function el(tag, attrs, text) {
  const ns = ["svg","polyline","line","text","circle","g","rect"].includes(tag)
    ? "http://www.w3.org/2000/svg" : "http://www.w3.org/1999/xhtml";
  const e = document.createElementNS(ns, tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function chart(box, series) {
  box.textContent = "";
  const names = Object.keys(series).sort();
  if (!names.length) { box.appendChild(el("div", {"class": "na"}, NA[box.dataset.group])); return; }
  const W = 460, H = 200, L = 58, R = 10, T = 8, B = 22;
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
  for (const n of names) for (const [x, y] of series[n]) {
    if (y === null) continue;
    x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
  }
  if (!isFinite(x0)) { x0 = 0; x1 = 1; y0 = 0; y1 = 1; }
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += Math.abs(y1) * 0.05 || 1; y0 -= Math.abs(y0) * 0.05 || 0; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = el("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, "data-group": box.dataset.group});
  svg.appendChild(el("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fbfcfd", stroke: "#ccd"}));
  for (let i = 0; i <= 4; i++) {
    const yv = y0 + (y1 - y0) * i / 4, xv = x0 + (x1 - x0) * i / 4;
    svg.appendChild(el("line", {x1: L, x2: W - R, y1: sy(yv), y2: sy(yv), stroke: "#eceff3"}));
    svg.appendChild(el("text", {x: L - 4, y: sy(yv) + 3, "text-anchor": "end"}, fmt(yv)));
    svg.appendChild(el("text", {x: sx(xv), y: H - 6, "text-anchor": i === 4 ? "end" : "middle"},
                        String(Math.round(xv))));
  }
  const legend = el("div", {"class": "legend"});
  names.forEach((n, k) => {
    const pts = series[n].filter(p => p[1] !== null);
    const c = COLORS[k % COLORS.length];
    const line = el("polyline", {fill: "none", stroke: c, "stroke-width": 1.6,
      points: pts.map(p => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "),
      "data-series": n, "data-values": pts.map(p => p[0] + ":" + p[1]).join(",")});
    svg.appendChild(line);
    if (pts.length === 1) svg.appendChild(el("circle", {cx: sx(pts[0][0]), cy: sy(pts[0][1]), r: 2.5, fill: c}));
    const last = series[n].length ? series[n][series[n].length - 1] : null;
    const s = el("span", {"data-series": n, "data-last": last ? last[1] : ""});
    s.appendChild(el("i", {style: "background:" + c}));
    s.appendChild(document.createTextNode(n + " " + (last ? fmt(last[1]) + " @" + last[0] : "")));
    legend.appendChild(s);
  });
  box.appendChild(svg); box.appendChild(legend);
}
let lastVersion = -1, netLoaded = false;
function render(run) {
  document.getElementById("net-name").textContent = run.facts.net || "run";
  const st = document.getElementById("status");
  st.textContent = run.status; st.className = run.status;
  st.dataset.status = run.status;
  document.getElementById("where").textContent = run.source ? "from " + run.source : "";
  const facts = document.getElementById("facts"); facts.textContent = "";
  const rows = Object.assign({iteration: run.iteration + (run.max_iter ? " of " + run.max_iter : "")}, run.facts);
  for (const k in rows) {
    if (k === "max_iter") continue;
    const tr = el("tr", {"data-fact": k});
    tr.appendChild(el("td", {"class": "k"}, k)); tr.appendChild(el("td", {}, String(rows[k])));
    facts.appendChild(tr);
  }
  document.querySelector("#bar div").style.width =
    run.max_iter ? Math.min(100, 100 * run.iteration / run.max_iter) + "%" : "0";
  document.getElementById("snapshots").textContent =
    run.snapshots.length ? run.snapshots.map(s => s[1] + " (iteration " + s[0] + ")").join("\n") : "none yet";
  document.getElementById("snapshots").style.whiteSpace = "pre-line";
  const groups = {};
  for (const n in run.series) { const g = groupOf(n); if (g) (groups[g] = groups[g] || {})[n] = run.series[n]; }
  if (!groups.speed && run.series["speed/iter_per_s"]) {  // a log: iterations/s only
    groups.speed = {"speed/iter_per_s": run.series["speed/iter_per_s"]};
    document.getElementById("speed-title").textContent = "Iterations per second";
  }
  for (const box of document.querySelectorAll(".chart")) chart(box, groups[box.dataset.group] || {});
}
function loadNet() {
  if (netLoaded) return; netLoaded = true;
  fetch("net.svg" + Q).then(r => r.ok ? r.text() : Promise.reject(r)).then(svg => {
    const img = el("img", {alt: "net drawing", src: "net.svg" + Q});
    const box = document.getElementById("net-draw"); box.textContent = ""; box.appendChild(img);
  }).catch(r => r.text ? r.text().then(t => { document.getElementById("net-draw").textContent = t; })
                          : (document.getElementById("net-draw").textContent = "no drawing"));
}
function poll() {
  const since = (Q ? Q + "&" : "?") + "since=" + lastVersion;
  fetch("api/run" + since, {cache: "no-store"}).then(r => r.ok ? r.json() : Promise.reject(r.status))
  .then(run => {
    if (run.unchanged) { setTimeout(poll, 1000); return; }
    if (run.version !== lastVersion) { lastVersion = run.version; render(run); }
    loadNet();
    if (run.status === "training" || run.status === "unfinished") setTimeout(poll, 1000);
  }).catch(why => {
    const st = document.getElementById("status");
    st.textContent = (st.dataset.status || "") + " (server unreachable: the run has ended? showing the last data)";
    st.className = "gone";
  });
}
poll();
</script></body></html>
"""
