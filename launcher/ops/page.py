"""The dashboard's single page: inline HTML, CSS, JS and SVG; no network access beyond its server.

Promises: the page renders the status document (``/api/state``) and re-renders on every
``state`` event of ``/api/stream``; each GPU shows its worker's busy time per step and its
measured speed when known, and a "Device speeds" table lists busy time, planned and measured
speed per device once any is known, and why the plan leaves a device idle; values from etcd
are inserted as text nodes or attribute values (``textContent``, ``append`` of strings, ``setAttribute``), never as HTML (no
``innerHTML``), so a ``<script>`` in a value shows as typed; ``CSP`` is the page's
Content-Security-Policy: only its own inline script (by hash) runs, and it connects only to its
own origin;
elements carry ``data-*`` attributes (``data-device``/``data-health``, ``data-event-type``,
``data-stage``, ``data-speed-device`` with ``data-busy``/``data-planned``/``data-measured``/
``data-idle`` on a row of the speeds table; ``data-source`` on the body: ``state`` or ``stream``) so tests and
scripts can find them. ``?stream=0`` renders one snapshot; ``?stream=once`` renders the first
pushed document and closes the stream (both let a headless browser finish loading).
"""

import base64
import hashlib

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>hspmd-elastic dashboard</title>
<style>
:root{--bg:#f4f6f9;--card:#fff;--ink:#1d2733;--mute:#6b7785;--line:#e1e6ec;
--healthy:#2e9d5b;--degraded:#e0a100;--suspect:#e06a00;--failed:#d6333a;--unknown:#9aa5b1;--lost:#8e44ad;
--accent:#2f6fdf}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);
font:14px/1.4 "DejaVu Sans","Liberation Sans",Arial,sans-serif}
header{display:flex;align-items:center;gap:18px;padding:12px 20px;background:#1d2733;color:#fff}
header h1{font-size:17px;margin:0;font-weight:600}
header .stat{font-size:13px;color:#c9d3de}
header .stat b{color:#fff}
#live{margin-left:auto;font-size:12px;padding:3px 9px;border-radius:10px;background:#56616d}
#live.on{background:var(--healthy)}
main{display:grid;grid-template-columns:1fr 1fr;gap:14px;padding:14px 20px}
section{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:12px 14px;
min-width:0}
section h2{font-size:13px;text-transform:uppercase;letter-spacing:.06em;color:var(--mute);
margin:0 0 10px}
.wide{grid-column:1 / span 2}
.empty{color:var(--mute);font-style:italic}
.nodes{display:flex;flex-wrap:wrap;gap:10px}
.node{border:1px solid var(--line);border-radius:6px;padding:8px 10px;min-width:210px}
.node.lost{border-style:dashed;border-color:var(--lost)}
.node .title{display:flex;justify-content:space-between;gap:8px;font-weight:600}
.node .meta{color:var(--mute);font-size:12px;margin-bottom:6px}
.badge{font-size:11px;padding:1px 7px;border-radius:9px;color:#fff;background:var(--unknown);
font-weight:600;white-space:nowrap}
.b-running,.b-ready,.b-healthy{background:var(--healthy)}
.b-joining,.b-switching,.b-draining,.b-degraded{background:var(--degraded)}
.b-failed{background:var(--failed)}.b-lost{background:var(--lost)}
.gpus{display:flex;flex-wrap:wrap;gap:6px}
.gpu{width:92px;border-radius:5px;padding:5px 6px;color:#fff;font-size:12px}
.gpu .n{font-weight:700}.gpu .r{font-size:11px;opacity:.95;overflow-wrap:anywhere}
.h-healthy{background:var(--healthy)}.h-degraded{background:var(--degraded)}
.h-suspect{background:var(--suspect)}
.h-failed{background:var(--failed)}.h-unknown{background:var(--unknown)}
.h-lost{background:var(--lost)}
.legend{display:flex;gap:12px;font-size:12px;color:var(--mute);margin-top:8px}
.legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px}
.pipe{display:flex;align-items:stretch;gap:6px;margin-bottom:8px}
.pipe .label{width:86px;font-size:12px;color:var(--mute);padding-top:6px}
.stage{border:1px solid var(--line);border-radius:5px;padding:5px 6px;background:#f8fafc;
min-width:90px}
.stage .lay{font-size:12px;font-weight:600}
.chip{display:inline-block;font-size:11px;color:#fff;border-radius:4px;padding:1px 5px;
margin:3px 3px 0 0}
.history{font-size:12px;color:var(--mute);margin-top:6px}
table{border-collapse:collapse;width:100%;font-size:13px}
th{text-align:left;color:var(--mute);font-weight:600;border-bottom:1px solid var(--line);
padding:4px 6px}
td{border-bottom:1px solid #f0f2f5;padding:4px 6px;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.t{font-weight:600}
.t-failure,.t-switch-failed,.t-fallback{color:var(--failed)}
.t-switch-done,.t-join,.t-recover{color:var(--healthy)}
.t-replan{color:var(--accent)}
.t-restart,.t-degrade,.t-stall{color:#b07d00}.t-leave{color:var(--lost)}
svg text{font:11px "DejaVu Sans",Arial,sans-serif;fill:var(--mute)}
.big{font-size:22px;font-weight:700}
.waits div{font-size:13px;margin:2px 0}
progress{width:160px;vertical-align:middle}
</style></head>
<body>
<header><h1>hspmd-elastic &middot; job <span id="job">&hellip;</span></h1>
<span class="stat">leader <b id="leader">-</b></span>
<span class="stat">plan <b id="planv">-</b></span>
<span class="stat">step <b id="step">-</b></span>
<span class="stat">steps/s <b id="rate">-</b></span>
<span class="stat">switches <b id="sw">-</b></span>
<span class="stat">revision <b id="rev">-</b></span>
<span id="live">connecting</span></header>
<main>
<section id="cluster"><h2>Cluster map</h2><div id="nodes" class="nodes"></div>
<div class="legend"><span><i class="h-healthy"></i>healthy</span>
<span><i class="h-degraded"></i>degraded</span><span><i class="h-suspect"></i>suspect</span>
<span><i class="h-failed"></i>failed</span>
<span><i class="h-unknown"></i>no verdict</span><span><i class="h-lost"></i>lost</span></div>
<div id="waits" class="waits"></div></section>
<section id="plan"><h2>Plan</h2><div id="plan-body"></div></section>
<section id="timeline"><h2>Events timeline</h2><div id="tl"></div></section>
<section id="throughput"><h2>Step throughput</h2><div id="tp"></div></section>
<section id="speeds" class="wide"><h2>Device speeds</h2><div id="sp"></div></section>
<section id="events" class="wide"><h2>Recent events</h2><div id="ev"></div></section>
</main>
<script>
"use strict";
const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = {healthy:"#2e9d5b", degraded:"#e0a100", suspect:"#e06a00", failed:"#d6333a",
  unknown:"#9aa5b1", lost:"#8e44ad"};
const EVCOLORS = {failure:"#d6333a", "switch-failed":"#d6333a", fallback:"#d6333a",
  "switch-done":"#2e9d5b", replan:"#2f6fdf", join:"#2e9d5b",
  recover:"#2e9d5b", leave:"#8e44ad", restart:"#b07d00", degrade:"#e0a100", stall:"#e0a100",
  drain:"#e06a00", drained:"#e06a00", unreachable:"#8e44ad", retry:"#b7950b", speeds:"#0f8b8d"};
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) e.setAttribute(k, v);
  }
  for (const k of kids) { if (k !== null && k !== undefined) e.append(k); }
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function hhmmss(t) {
  if (t === null || t === undefined) return "-";
  return new Date(t * 1000).toLocaleTimeString("en-GB", {hour12: false});
}
function fmtBytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n.toFixed(0)) + " " + u[i];
}
function put(id, node) { const box = document.getElementById(id); box.replaceChildren(node); }
function text(id, s) { document.getElementById(id).textContent = s; }

function renderHeader(d) {
  text("job", d.job);
  text("leader", d.leader ? d.leader.node + " (term " + d.leader.term + ")" : "none");
  text("planv", d.plan ? "v" + d.plan.version : "none");
  text("step", d.throughput.step === null ? "-" : d.throughput.step);
  text("rate", d.throughput.steps_per_s === null ? "-" : d.throughput.steps_per_s.toFixed(3));
  text("sw", d.switches.total + " (" + d.switches.seconds_total.toFixed(2) + " s)");
  text("rev", d.revision);
}

function renderNodes(d) {
  if (!d.nodes.length) { put("nodes", el("div", {class: "empty"}, "no nodes registered")); return; }
  const box = el("div", {class: "nodes"});
  for (const n of d.nodes) {
    const ranks = n.workers.map(w => w.global_rank).join(", ");
    const card = el("div", {class: "node" + (n.present ? "" : " lost"), "data-node": n.id},
      el("div", {class: "title"}, n.id, el("span", {class: "badge b-" + n.state}, n.state)),
      el("div", {class: "meta"}, (n.host || "no record") +
        (n.workers.length ? " \u00b7 ranks " + ranks : " \u00b7 no workers")));
    const gpus = el("div", {class: "gpus"});
    for (const g of n.devices) {
      const where = g.placement ? "P" + g.placement.pipeline + " S" + g.placement.stage +
        " T" + g.placement.tp_rank : (g.in_plan ? "in plan" : "not in plan");
      const box2 = el("div", {class: "gpu h-" + g.health, "data-device": g.id,
        "data-health": g.health, title: g.reason || g.health},
        el("div", {class: "n"}, (g.type || "device") + " " + g.index),
        el("div", {}, g.health === "unknown" ? "no verdict" : g.health),
        el("div", {class: "r"}, where));
      const w = n.workers.find(x => x.local_rank === g.index);
      if (w && w.busy_s > 0) {
        box2.append(el("div", {class: "r"}, "busy " + w.busy_s.toFixed(3) + " s"));
      }
      if (g.measured_speed !== null) {
        box2.append(el("div", {class: "r"}, "speed " + g.measured_speed.toFixed(2)));
      }
      if (g.reason) box2.append(el("div", {class: "r"}, g.reason));
      if (g.replaced_by_plan !== null) {
        box2.append(el("div", {class: "r"}, "replaced by plan v" + g.replaced_by_plan));
      }
      gpus.append(box2);
    }
    if (!n.devices.length) gpus.append(el("div", {class: "empty"}, "no devices reported"));
    card.append(gpus);
    box.append(card);
  }
  put("nodes", box);
  const waits = el("div", {});
  for (const w of d.waits) {
    const bar = w.total === null ? el("progress", {}) :
      el("progress", {max: w.total, value: w.done});
    waits.append(el("div", {"data-wait": w.kind}, w.label + " ", bar,
      " " + w.done + (w.total === null ? "" : "/" + w.total) +
      (w.elapsed_s === null ? "" : " \u00b7 " + w.elapsed_s.toFixed(1) + " s")));
  }
  put("waits", waits);
}

function renderPlan(d) {
  const p = d.plan;
  if (!p) { put("plan-body", el("div", {class: "empty"}, "no plan published")); return; }
  const health = {};
  for (const n of d.nodes) for (const g of n.devices) health[g.id] = g.health;
  const body = el("div", {"data-plan-version": p.version},
    el("div", {class: "big"}, "v" + p.version),
    el("div", {class: "meta"}, p.reason + " \u00b7 " + p.devices.length +
      (p.devices.length === 1 ? " device" : " devices") + " \u00b7 store " +
      p.store_endpoint + " \u00b7 " + hhmmss(p.created_at)));
  if (p.layout_error) {
    body.append(el("div", {class: "empty"}, p.layout_error),
      el("pre", {}, JSON.stringify(p.strategy)), el("div", {}, "devices: " + p.devices.join(", ")));
  }
  const layers = p.num_layers || 1;
  for (const pipe of p.pipelines) {
    const row = el("div", {class: "pipe"}, el("div", {class: "label"}, "pipeline " + pipe.index +
      "\n" + pipe.num_microbatches + "\u00d7" + pipe.microbatch_size));
    for (const st of pipe.stages) {
      const span = st.layers[1] - st.layers[0];
      const box = el("div", {class: "stage", "data-stage": pipe.index + "." + st.index,
        style: "flex:" + span + " 1 0"},
        el("div", {class: "lay"}, "S" + st.index + " \u00b7 layers " + st.layers[0] + "\u2013" +
          (st.layers[1] - 1) + " \u00b7 TP" + st.tp));
      for (const dev of st.devices) {
        box.append(el("span", {class: "chip h-" + (health[dev] || "unknown")}, dev));
      }
      row.append(box);
    }
    body.append(row);
  }
  for (const b of (p.buckets || [])) {
    body.append(el("div", {class: "history", "data-bucket": b.index}, b.error ?
      "bucket " + b.index + ": " + b.error :
      "\u2264 " + b.window + " tokens, rows " + b.start + "+" + b.rows + ": " + b.layout +
      (b.switches ? " (own plan, switched in the step)" : " (home layout)")));
  }
  if (d.plan_history.length) {
    body.append(el("div", {class: "history"}, "history: " + d.plan_history.slice(-6)
      .map(h => "v" + h.version + " " + h.reason).join(" \u2192 ")));
  }
  put("plan-body", body);
}

function renderTimeline(d) {
  const evs = d.events.recent;
  if (!evs.length) { put("tl", el("div", {class: "empty"}, "no events recorded")); return; }
  const W = 600, H = 130, L = 10, R = 10;
  let t0 = Math.min(...evs.map(e => e.at)), t1 = Math.max(...evs.map(e => e.at), d.generated_at);
  if (t1 - t0 < 1) t1 = t0 + 1;
  const x = t => L + (W - L - R) * (t - t0) / (t1 - t0);
  const s = svg("svg", {viewBox: "0 0 " + W + " " + H, width: "100%", "data-timeline": "1"});
  s.append(svg("line", {x1: L, x2: W - R, y1: 96, y2: 96, stroke: "#c5ccd4"}));
  for (const sw of d.switches.recent) {
    if (sw.started_at === null) continue;
    const end = sw.finished_at === null ? d.generated_at : sw.finished_at;
    const col = sw.state === "failed" ? "#d6333a" : sw.state === "done" ? "#2e9d5b" : "#2f6fdf";
    s.append(svg("rect", {x: x(sw.started_at), y: 22, height: 16, rx: 3,
      width: Math.max(4, x(end) - x(sw.started_at)), fill: col, opacity: 0.85}));
    const label = "v" + sw.to_version + (sw.duration_s === null ? " \u2026" :
      " " + sw.duration_s.toFixed(2) + " s");
    const right = x(sw.started_at) > W * 0.75;  // keep the label inside the chart
    s.append(svg("text", {x: right ? x(end) : x(sw.started_at), y: 16,
      "text-anchor": right ? "end" : "start", "data-switch": sw.to_version}, label));
  }
  evs.forEach((e, i) => {
    const cx = x(e.at), cy = 60 + (i % 3) * 10;
    s.append(svg("line", {x1: cx, x2: cx, y1: cy, y2: 96, stroke: "#dde2e8"}));
    const dot = svg("circle", {cx: cx, cy: cy, r: 5, fill: EVCOLORS[e.type] || "#6b7785",
      "data-event-type": e.type});
    dot.append(svg("title", {}, "#" + e.seq + " " + e.type + " " + e.summary));
    s.append(dot);
  });
  s.append(svg("text", {x: L, y: 114}, hhmmss(t0)));
  s.append(svg("text", {x: W - R, y: 114, "text-anchor": "end"}, hhmmss(t1)));
  const legend = el("div", {class: "legend"});
  for (const t of [...new Set(evs.map(e => e.type))]) {
    legend.append(el("span", {}, el("i", {style: "background:" + (EVCOLORS[t] || "#6b7785")}), t));
  }
  const box = el("div", {}, s, legend);
  put("tl", box);
}

function renderThroughput(d) {
  const tp = d.throughput, pts = tp.samples;
  const head = el("div", {}, el("span", {class: "big"},
    tp.steps_per_s === null ? "-" : tp.steps_per_s.toFixed(3)), " steps/s \u00b7 step " +
    (tp.step === null ? "-" : tp.step) + " \u00b7 " + tp.workers + " workers");
  if (pts.length < 2) {
    put("tp", el("div", {}, head, el("div", {class: "empty"}, "no throughput samples yet")));
    return;
  }
  const W = 580, H = 150, L = 34, B = 18;
  const t0 = pts[0][0], t1 = Math.max(pts[pts.length - 1][0], t0 + 1);
  const ymax = Math.max(...pts.map(p => p[1]), 0.001) * 1.15;
  const x = t => L + (W - L - 6) * (t - t0) / (t1 - t0), y = v => 6 + (H - B - 6) * (1 - v / ymax);
  const s = svg("svg", {viewBox: "0 0 " + W + " " + H, width: "100%", "data-chart": "steps"});
  s.append(svg("line", {x1: L, x2: W - 6, y1: H - B, y2: H - B, stroke: "#c5ccd4"}));
  s.append(svg("line", {x1: L, x2: L, y1: 6, y2: H - B, stroke: "#c5ccd4"}));
  s.append(svg("text", {x: L - 4, y: 12, "text-anchor": "end"}, ymax.toFixed(2)));
  s.append(svg("text", {x: L - 4, y: H - B, "text-anchor": "end"}, "0"));
  s.append(svg("text", {x: L, y: H - 4}, hhmmss(t0)));
  s.append(svg("text", {x: W - 6, y: H - 4, "text-anchor": "end"}, hhmmss(t1)));
  const line = pts.map(p => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ");
  s.append(svg("polyline", {points: line, fill: "none", stroke: "#2f6fdf", "stroke-width": 2}));
  put("tp", el("div", {}, head, s));
}

function speedRows(d) {
  const rows = new Map();
  for (const n of d.nodes) {
    for (const g of n.devices) {
      if (g.planned_speed !== null || g.measured_speed !== null || g.idle) {
        rows.set(g.id, {id: g.id, rank: null, busy: 0, planned: g.planned_speed,
          measured: g.measured_speed, idle: g.idle || null});
      }
    }
    for (const w of n.workers) {
      if (!(w.busy_s > 0)) continue;
      const id = n.id + ":" + w.local_rank;
      if (!rows.has(id)) {
        rows.set(id, {id: id, rank: null, busy: 0, planned: null, measured: null, idle: null});
      }
      Object.assign(rows.get(id), {rank: w.global_rank, busy: w.busy_s});
    }
  }
  return [...rows.values()].sort((a, b) => a.id < b.id ? -1 : a.id > b.id ? 1 : 0);
}

function renderSpeeds(d) {
  const rows = speedRows(d);
  if (!rows.length) {
    put("sp", el("div", {class: "empty"}, "no busy time or speeds measured yet"));
    return;
  }
  const num = v => v === null ? "-" : v.toFixed(2);
  const tb = el("tbody");
  for (const r of rows) {
    tb.append(el("tr", {"data-speed-device": r.id, "data-busy": r.busy,
      "data-planned": r.planned, "data-measured": r.measured, "data-idle": r.idle || ""},
      el("td", {}, r.id), el("td", {class: "num"}, r.rank === null ? "-" : r.rank),
      el("td", {class: "num"}, r.busy > 0 ? r.busy.toFixed(4) + " s" : "-"),
      el("td", {class: "num"}, num(r.planned)), el("td", {class: "num"}, num(r.measured)),
      el("td", {}, r.idle || "-")));
  }
  const head = el("tr", {}, ...["device", "rank", "busy / step", "planned speed",
    "measured speed (1.00 = fastest)", "idle: why"].map(h => el("th", {}, h)));
  put("sp", el("table", {}, el("thead", {}, head), tb));
}

function renderEvents(d) {
  const evs = d.events.recent.slice().reverse().slice(0, 14);
  if (!evs.length) { put("ev", el("div", {class: "empty"}, "no events recorded")); return; }
  const tb = el("tbody");
  for (const e of evs) {
    tb.append(el("tr", {"data-event-type": e.type, "data-seq": e.seq},
      el("td", {}, hhmmss(e.at)), el("td", {class: "num"}, "#" + e.seq),
      el("td", {class: "t t-" + e.type}, e.type), el("td", {}, e.node || "-"),
      el("td", {}, e.summary),
      el("td", {class: "num"}, e.duration_s === null ? "" : e.duration_s.toFixed(2) + " s")));
  }
  const head = el("tr", {}, ...["time", "seq", "type", "node", "what", "took"]
    .map(h => el("th", {}, h)));
  put("ev", el("table", {}, el("thead", {}, head), tb));
}

function render(d, source) {
  for (const f of [renderHeader, renderNodes, renderPlan, renderTimeline, renderThroughput,
                   renderSpeeds, renderEvents]) {
    try { f(d); } catch (err) { console.error(f.name, err); }
  }
  document.body.setAttribute("data-revision", d.revision);
  document.body.setAttribute("data-source", source);
}

// ?stream=0: one snapshot from /api/state; ?stream=once: only the first pushed document
// (headless checks of the stream); default: a snapshot, then every pushed change.
const MODE = (location.search.match(/[?&]stream=(0|once)/) || [])[1] || "live";
function connect(once) {
  const live = document.getElementById("live");
  const es = new EventSource("api/stream");
  es.addEventListener("state", m => {
    render(JSON.parse(m.data), "stream");
    if (once) { es.close(); live.textContent = "one push"; live.className = ""; }
  });
  es.onopen = () => { live.textContent = "live"; live.className = "on"; };
  es.onerror = () => { live.textContent = "reconnecting"; live.className = ""; };
}
if (MODE === "once") {
  connect(true);
} else {
  fetch("api/state").then(r => r.json()).then(d => render(d, "state"))
    .catch(e => console.error(e))
    .finally(() => {
      if (MODE === "live") { connect(false); return; }
      const live = document.getElementById("live");
      live.textContent = "snapshot"; live.className = "";
    });
}
</script>
</body></html>
"""


def _script_hash(page: str) -> str:
    script = page.split("<script>", 1)[1].split("</script>", 1)[0]
    return "sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()


CSP = (f"default-src 'none'; script-src '{_script_hash(PAGE)}'; style-src 'unsafe-inline'; "
       "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
