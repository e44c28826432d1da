"""The control API's built-in web page, for users without Grafana: /ui lists the jobs, /ui/jobs/NAME
charts one job's reward, staleness, throughput and evaluations per version, refreshed every 2 s. Plain
HTML + JS + SVG, nothing fetched from elsewhere (works offline).

Auth: the HTML and JS are served without a token (they hold no data); the script calls the API's JSON
routes with `Authorization: Bearer <token>`, the token pasted once into the page and kept in the tab's
sessionStorage. A link may carry it in the URL *fragment* (`/ui#token=...`): a fragment never reaches the
server (so never its logs); the script moves it into sessionStorage and removes it from the address bar.
"""

from __future__ import annotations

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.2em 2em; color: #222; background: #fafafa; }
h1 { font-size: 1.4em; margin: 0 0 .4em; } a { color: #1f5fbf; }
#auth { display: none; margin: 1em 0; padding: .8em; background: #fff3cd; border: 1px solid #e0c97a; }
#auth input { width: 28em; font-family: monospace; }
#msg { color: #a00; margin: .5em 0; min-height: 1.2em; }
table { border-collapse: collapse; background: #fff; } td, th { padding: .3em .8em; border: 1px solid #ddd; }
th { background: #eee; text-align: left; }
.charts { display: grid; grid-template-columns: repeat(2, minmax(420px, 1fr)); gap: 1em; }
.chart { background: #fff; border: 1px solid #ddd; padding: .4em; }
.chart h2 { font-size: 1em; margin: .1em .3em; }
.status { margin: .3em 0 1em; } .status span { margin-right: 1.5em; }
svg text { font: 11px system-ui, sans-serif; fill: #444; }
"""

_SHELL = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{style}</style></head>
<body data-page="{page}">
<h1>{heading}</h1>
<div id="auth">The control API token (<code>$SLIPSTREAM_HOME/secrets.json</code>, <code>api_token</code>);
kept in this tab only: <input id="token" type="password" autocomplete="off">
<button id="save">Use</button></div>
<div id="msg"></div>
{body}
<script src="/ui/app.js"></script>
</body></html>
"""

JOBS_HTML = _SHELL.format(
    title="Slipstream jobs",
    style=_STYLE,
    page="jobs",
    heading="Slipstream jobs",
    body='<table id="jobs"><thead><tr><th>job</th><th>state</th><th>version</th><th>reward</th>'
    "<th>generators</th><th>trainers</th></tr></thead><tbody></tbody></table>",
)

JOB_HTML = _SHELL.format(
    title="Slipstream job",
    style=_STYLE,
    page="job",
    heading='<a href="/ui">jobs</a> / <span id="name"></span>',
    body='<div class="status" id="status"></div>'
    '<div class="charts">'
    '<div class="chart"><h2>Reward (mean)</h2><div id="c-reward"></div></div>'
    '<div class="chart"><h2>Staleness of trained groups (versions behind)</h2><div id="c-stale"></div></div>'
    '<div class="chart"><h2>Throughput (tokens/s)</h2><div id="c-tps"></div></div>'
    '<div class="chart"><h2>Step time (s)</h2><div id="c-step"></div></div>'
    '<div class="chart"><h2>Staleness of every consumed group (groups per versions behind)</h2>'
    '<div id="c-hist"></div></div>'
    '<div class="chart"><h2>Evaluation on the held-out set (a spec with <code>eval</code>)</h2>'
    '<div id="c-eval"></div></div>'
    "</div>",
)

APP_JS = r"""
"use strict";
const KEY = "slipstream_api_token";
const REFRESH_MS = 2000;
const $ = (id) => document.getElementById(id);

(function takeFragmentToken() {
  const m = location.hash.match(/(?:^#|&)token=([^&]+)/);
  if (m) {
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
})();

function showAuth(why) {
  $("auth").style.display = "block";
  $("msg").textContent = why || "";
}

$("save").addEventListener("click", () => {
  const t = $("token").value.trim();
  if (t) { sessionStorage.setItem(KEY, t); $("token").value = ""; $("auth").style.display = "none"; tick(); }
});

async function api(path) {
  const token = sessionStorage.getItem(KEY);
  if (!token) { showAuth("This page needs the control API token."); throw new Error("no token"); }
  const r = await fetch(path, { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
  if (r.status === 401) {
    sessionStorage.removeItem(KEY);
    showAuth("The token was refused; paste it again.");
    throw new Error("unauthorized");
  }
  if (!r.ok) { let d = r.statusText; try { d = (await r.json()).detail; } catch (e) {} throw new Error(d); }
  return r.json();
}

function el(tag, attrs, text) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(v) {
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(1);
  return v.toFixed(2);
}

// series: [{label, color, key}], records: progress records; x is the version
function lineChart(container, records, series) {
  const W = 520, H = 240, L = 52, R = 10, T = 24, B = 30;
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img" });
  const pts = series.map((s) => records
    .filter((r) => typeof r[s.key] === "number" && typeof r.version === "number")
    .map((r) => [r.version, r[s.key]]));
  const all = pts.flat();
  container.replaceChildren(svg);
  if (!all.length) { svg.appendChild(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet")); return; }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(0, ...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) y1 = y0 + 1;
  y1 += (y1 - y0) * 0.05;
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: sy(y), y2: sy(y), stroke: "#eee" }));
    svg.appendChild(el("text", { x: L - 4, y: sy(y) + 4, "text-anchor": "end" }, fmt(y)));
  }
  for (let i = 0; i <= 5; i++) {
    const x = x0 + (x1 - x0) * i / 5;
    svg.appendChild(el("text", { x: sx(x), y: H - B + 14, "text-anchor": "middle" }, fmt(x)));
  }
  svg.appendChild(el("text", { x: W - R, y: H - 3, "text-anchor": "end" }, "version"));
  svg.appendChild(el("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#ccc" }));
  series.forEach((s, i) => {
    const p = pts[i];
    if (p.length) {
      svg.appendChild(el("polyline", {
        points: p.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "),
        fill: "none", stroke: s.color, "stroke-width": 1.8,
      }));
      if (p.length < 60) p.forEach(([x, y]) => svg.appendChild(el("circle", { cx: sx(x), cy: sy(y), r: 2, fill: s.color })));
    }
    const lx = L + 8 + i * 170;
    svg.appendChild(el("rect", { x: lx, y: 8, width: 12, height: 4, fill: s.color }));
    const last = p.length ? " " + fmt(p[p.length - 1][1]) : "";
    svg.appendChild(el("text", { x: lx + 16, y: 14 }, s.label + last));
  });
}

function barChart(container, hist) {
  const W = 520, H = 240, L = 52, R = 10, T = 14, B = 30;
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img" });
  container.replaceChildren(svg);
  const ks = Object.keys(hist || {}).map(Number).filter((k) => !isNaN(k)).sort((a, b) => a - b);
  if (!ks.length) { svg.appendChild(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet")); return; }
  const top = Math.max(1, ...ks.map((k) => hist[k]));
  const bw = (W - L - R) / ks.length;
  for (let i = 0; i <= 4; i++) {
    const y = H - B - i / 4 * (H - T - B);
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: y, y2: y, stroke: "#eee" }));
    svg.appendChild(el("text", { x: L - 4, y: y + 4, "text-anchor": "end" }, fmt(top * i / 4)));
  }
  ks.forEach((k, i) => {
    const h = hist[k] / top * (H - T - B);
    svg.appendChild(el("rect", { x: L + i * bw + bw * 0.1, y: H - B - h, width: bw * 0.8, height: h, fill: "#36c" }));
    svg.appendChild(el("text", { x: L + (i + 0.5) * bw, y: H - B + 14, "text-anchor": "middle" }, String(k)));
  });
  svg.appendChild(el("text", { x: W - R, y: H - 3, "text-anchor": "end" }, "versions behind"));
}

const CHARTS = [
  ["c-reward", [{ key: "reward_mean", label: "reward", color: "#2a7" }]],
  ["c-stale", [{ key: "staleness_mean", label: "mean", color: "#36c" }, { key: "staleness_max", label: "max", color: "#d62" }]],
  ["c-tps", [{ key: "tokens_per_s", label: "generated", color: "#36c" }, { key: "train_tokens_per_s", label: "trained", color: "#d62" }]],
  ["c-step", [{ key: "step_s", label: "step", color: "#36c" }, { key: "wait_s", label: "wait for data", color: "#999" }]],
];

const state = { records: [], next: 0, run: null };

function cell(tr, content) { const td = document.createElement("td"); td.append(content); tr.appendChild(td); }

async function tickJobs() {
  const jobs = await api("/jobs");
  const body = $("jobs").tBodies[0];
  body.replaceChildren();
  for (const j of jobs) {
    const tr = document.createElement("tr");
    const a = document.createElement("a");
    a.href = "/ui/jobs/" + encodeURIComponent(j.name);
    a.textContent = j.name;
    cell(tr, a);
    cell(tr, String(j.state ?? ""));
    cell(tr, `${j.version ?? 0}` + (j.total_steps ? ` / ${j.total_steps}` : ""));
    cell(tr, typeof j.reward_mean === "number" ? j.reward_mean.toFixed(3) : "");
    cell(tr, String((j.pools || {}).generators ?? ""));
    cell(tr, String((j.pools || {}).trainers ?? ""));
    body.appendChild(tr);
  }
}

async function tickJob() {
  const name = decodeURIComponent(location.pathname.split("/").pop());
  $("name").textContent = name;
  document.title = "Slipstream: " + name;
  const q = encodeURIComponent(name);
  const [st, pr] = await Promise.all([api(`/jobs/${q}`), api(`/jobs/${q}/progress?since=${state.next}`)]);
  if (pr.next < state.next || (state.next && pr.run !== state.run)) {  // a new run, attempt or trim
    state.records = []; state.next = 0; state.run = pr.run; return tickJob();
  }
  state.run = pr.run;
  state.records = state.records.concat(pr.records);
  state.next = pr.next;
  const p = st.pools || {}, b = st.buffer || {}, f = st.failure;
  const restarts = Object.values(st.restarts || {}).reduce((a, n) => a + n, 0);
  const items = [
    ["state", st.state], ["version", `${st.version ?? 0}` + (st.total_steps ? ` / ${st.total_steps}` : "")],
    ["generators", p.generators], ["rollout workers", p.rollout_workers], ["trainers", p.trainers],
    ["buffer depth", b.depth], ["dropped stale", b.dropped_stale], ["restarts", restarts || undefined],
    // the newest failure supervision handled (slipstream/job/supervise.py Failure)
    ["last failure", f ? `${f.who}: ${f.error_class} (${f.times} in a row, ${f.action}): ${f.cause}` : undefined],
    ["error", st.error],
  ];
  $("status").replaceChildren(...items.filter(([, v]) => v !== undefined && v !== null && v !== "").map(([k, v]) => {
    const s = document.createElement("span"); s.textContent = `${k}: ${v}`; return s;
  }));
  for (const [id, series] of CHARTS) lineChart($(id), state.records, series);
  barChart($("c-hist"), b.staleness);
  // evaluations: one record per version, its scores a flat dict (accuracy, greedy_reward, pass@k)
  const evals = (pr.evals || []).map((e) => ({ version: e.version, ...(e.eval || {}) }));
  const scores = [...new Set(evals.flatMap((e) => Object.keys(e)))]
    .filter((k) => k === "accuracy" || k === "greedy_reward" || k.startsWith("pass@")).sort();
  const colors = ["#2a7", "#36c", "#d62", "#999"];
  lineChart($("c-eval"), evals, scores.map((k, i) => ({ key: k, label: k, color: colors[i % colors.length] })));
}

async function tick() {
  try {
    if (document.body.dataset.page === "jobs") await tickJobs(); else await tickJob();
    $("msg").textContent = "";
  } catch (e) {
    if (e.message !== "no token" && e.message !== "unauthorized") $("msg").textContent = "refresh failed: " + e.message;
  }
}

tick();
setInterval(() => { if (sessionStorage.getItem(KEY)) tick(); }, REFRESH_MS);
"""
