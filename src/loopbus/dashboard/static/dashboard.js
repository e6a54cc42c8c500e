// The loopbus dashboard page: lists the runs (finished and live) and charts every record
// name, one chart per name, grouped by the name's prefix, one series per run.
//
// It reads the dashboard's JSON API (docs/dashboard.md): GET api/runs, POST api/lines
// (what a chart draws: the smallest and largest value per pixel column of the visible
// range, recomputed on zoom; with smoothing, also the smoothed line of every point in the
// same columns), POST api/csv (the exact points), and the Server-Sent Events
// of api/updates (runs that changed). An exported report carries the same data in the page
// (<script id="loopbus-data">) and answers the same questions here, offline.
//
// The view (filters, x axis, options, zoom aside) lives in the URL's fragment: a link
// reproduces it. The page raises "loopbus:status" on document with the live runs' table
// rows, for pages that add controls.
(() => {
"use strict";

const COLORS = ["#0969da", "#d1242f", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#bf3989",
  "#6e7781", "#4d2d00", "#0550ae", "#a40e26", "#116329"];
const HEIGHT = 230;
const GROUP_ORDER = ["train", "val", "validate", "test", "predict"];
const MIN_MARKER_GAP = 8;  // CSS pixels between drawn epoch markers, at least
const MARKER_STYLE = {
  epoch: { color: "#8c959f", width: 1, dash: [4, 4] },
  stage: { color: "#8250df", width: 2, dash: [] },
  gap: { color: "#cf222e", width: 2, dash: [2, 2] },
  resume: { color: "#bc4c00", width: 2, dash: [6, 3] },
};
const THIN = [];
for (let e = 0; e <= 12; e++) for (const m of [1, 2, 5]) THIN.push(m * 10 ** e);
const REFRESH_MS = 150;  // a chart asks again for its lines at most this often

const el = (id) => document.getElementById(id);
const embedded = document.getElementById("loopbus-data");
const OFFLINE = embedded ? JSON.parse(embedded.textContent) : null;

function fmt(v, digits) {
  if (v == null || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(Math.max(1, digits - 3));
  return String(Number(v.toPrecision(digits)));
}

// Debiased exponential moving average (what TensorBoard calls smoothing).
function ema(ys, w) {
  const out = new Array(ys.length);
  let last = 0, n = 0;
  for (let i = 0; i < ys.length; i++) {
    const y = ys[i];
    if (y == null || !Number.isFinite(y)) { out[i] = null; continue; }
    last = last * w + (1 - w) * y;
    n++;
    out[i] = last / (1 - w ** n);
  }
  return out;
}

// ------------------------------------------------------------------ the view, in the URL
const view = {
  runs: "", names: "", x: "step", smoothing: 0, log: false, clip: false, group: false,
  color: "", sort: "", desc: false,
};

function readView() {
  const q = new URLSearchParams(location.hash.slice(1));
  view.runs = q.get("runs") || "";
  view.names = q.get("names") || "";
  view.x = ["step", "relative", "wall"].includes(q.get("x")) ? q.get("x") : "step";
  view.smoothing = Math.min(0.99, Math.max(0, Number(q.get("smoothing")) || 0));
  view.log = q.get("log") === "1";
  view.clip = q.get("clip") === "1";
  view.group = q.get("group") === "1";
  view.color = q.get("color") || "";
  view.sort = q.get("sort") || "";
  view.desc = q.get("desc") === "1";
}

function writeView() {
  const q = new URLSearchParams();
  if (view.runs) q.set("runs", view.runs);
  if (view.names) q.set("names", view.names);
  if (view.x !== "step") q.set("x", view.x);
  if (view.smoothing) q.set("smoothing", String(view.smoothing));
  for (const key of ["log", "clip", "group"]) if (view[key]) q.set(key, "1");
  if (view.color) q.set("color", view.color);
  if (view.sort) q.set("sort", view.sort);
  if (view.desc) q.set("desc", "1");
  const hash = q.toString();
  history.replaceState(null, "", hash ? "#" + hash : location.pathname + location.search);
}

function regex(text, input) {
  try {
    const r = text ? new RegExp(text) : null;
    input.classList.remove("invalid");
    return r;
  } catch (e) {
    input.classList.add("invalid");
    return null;
  }
}

// ------------------------------------------------------------------ the data, online or not
function decimate(q) {  // what POST api/lines answers, from the embedded points
  const name = q.names[0], data = [], shown = [], markers = [];
  for (const id of q.runs) {
    const s = OFFLINE.scalars[id] && OFFLINE.scalars[id][name];
    if (!s) continue;
    const run = state.runs.get(id), origin = run.origin || 0;
    const xs = q.x === "step" ? s.step : q.x === "relative" ? s.wall_time.map((t) => t - origin) : s.wall_time;
    data.push([xs, s.value.map((v) => (typeof v === "number" ? v : Number(v)))]);
    shown.push(id);
    for (const m of run.markers || []) {
      const x = q.x === "step" ? m.step : m.time == null ? null : q.x === "relative" ? m.time - origin : m.time;
      if (x != null) markers.push({ run: id, kind: m.kind, x, label: m.label });
    }
  }
  const w = q.smoothing || 0;
  const kept = data.map(([xs, ys]) => {
    const kx = [], ky = [], ks = [], sm = w > 0 ? ema(ys, w) : null;  // of every point
    for (let i = 0; i < xs.length; i++) {
      const x = xs[i], y = ys[i];
      if (!Number.isFinite(y) || (q.lo != null && x < q.lo) || (q.hi != null && x > q.hi)) continue;
      kx.push(x); ky.push(y);
      if (sm) ks.push(sm[i]);
    }
    return [kx, ky, ks];
  });
  const points = kept.reduce((n, [kx]) => n + kx.length, 0);
  const total = data.reduce((n, [xs]) => n + xs.length, 0);
  if (!points) return { x: [], y: shown.map(() => []), s: shown.map(() => []), smoothing: w, runs: shown, points: 0, total, p: null, markers };
  const distinct = [...new Set(kept.flatMap(([kx]) => kx))].sort((a, b) => a - b);
  let edges, exact = distinct.length <= 2 * q.width;
  if (exact) edges = distinct;
  else {
    const lo = q.lo != null ? q.lo : distinct[0], hi = q.hi != null ? q.hi : distinct[distinct.length - 1];
    edges = Array.from({ length: q.width }, (_, i) => lo + ((hi - lo) * i) / q.width);
  }
  const n = edges.length, half = exact || n < 2 ? 0 : (edges[1] - edges[0]) / 2;
  const bin = (x) => {
    let a = 0, b = n - 1;
    while (a < b) { const m = (a + b + 1) >> 1; if (edges[m] <= x) a = m; else b = m - 1; }
    return a;
  };
  const extremes = (kx, ky) => {  // per column: its smallest and largest value, in order
    const lo = new Array(n).fill(-1), hi = new Array(n).fill(-1);
    for (let i = 0; i < kx.length; i++) {
      const b = bin(kx[i]);
      if (lo[b] < 0 || ky[i] < ky[lo[b]]) lo[b] = i;
      if (hi[b] < 0 || ky[i] > ky[hi[b]]) hi[b] = i;
    }
    const first = [], second = [];
    for (let b = 0; b < n; b++) {
      if (lo[b] < 0) { first.push(null); second.push(null); continue; }
      const [a, c] = lo[b] <= hi[b] ? [lo[b], hi[b]] : [hi[b], lo[b]];
      first.push(ky[a]); second.push(a === c || ky[a] === ky[c] && lo[b] === hi[b] ? null : ky[c]);
    }
    return [first, second];
  };
  const pairs = kept.map(([kx, ky]) => extremes(kx, ky));
  const smooth = w > 0 ? kept.map(([kx, , ks]) => extremes(kx, ks)) : [];
  const x = [], y = pairs.map(() => []), s = smooth.map(() => []);
  for (let b = 0; b < n; b++) {
    x.push(edges[b]);
    pairs.forEach(([f], i) => y[i].push(f[b]));
    smooth.forEach(([f], i) => s[i].push(f[b]));
    if (pairs.some(([, second]) => second[b] != null)) {
      x.push(edges[b] + half);
      pairs.forEach(([, second], i) => y[i].push(second[b]));
      smooth.forEach(([f, second], i) => s[i].push(second[b] != null ? second[b] : f[b]));
    }
  }
  const all = kept.flatMap(([, ky]) => ky).sort((a, b) => a - b);
  const pct = (p) => { const r = (all.length - 1) * p, i = Math.floor(r); return all[i] + (all[Math.min(i + 1, all.length - 1)] - all[i]) * (r - i); };
  return { x, y, s, smoothing: w, runs: shown, points, total, p: [pct(0.01), pct(0.99)], markers };
}

function csvLocal(q) {
  const rows = ["run,name,step,wall_time,value"];
  const quote = (s) => (/[",\n]/.test(s) ? '"' + s.replace(/"/g, '""') + '"' : s);
  for (const id of q.runs) {
    const names = q.names.length ? q.names : Object.keys(OFFLINE.scalars[id] || {}).sort();
    for (const name of names) {
      const s = OFFLINE.scalars[id] && OFFLINE.scalars[id][name];
      if (!s) continue;
      for (let i = 0; i < s.step.length; i++) {
        rows.push([quote(id), quote(name), s.step[i], s.wall_time[i], s.value[i]].join(","));
      }
    }
  }
  return rows.join("\n") + "\n";
}

const api = {
  async runs() {
    if (OFFLINE) return OFFLINE.runs;
    const r = await fetch("api/runs");
    if (!r.ok) throw new Error(`api/runs answered ${r.status}`);
    return r.json();
  },
  async lines(q) {
    if (OFFLINE) return decimate(q);
    const r = await fetch("api/lines", { method: "POST", body: JSON.stringify(q) });
    if (!r.ok) throw new Error(`api/lines answered ${r.status}: ${await r.text()}`);
    return r.json();
  },
  async csv(q) {
    if (OFFLINE) return csvLocal(q);
    const r = await fetch("api/csv", { method: "POST", body: JSON.stringify(q) });
    if (!r.ok) throw new Error(`api/csv answered ${r.status}`);
    return r.text();
  },
};

// ------------------------------------------------------------------ the runs
const state = {
  runs: new Map(),     // id -> run (GET api/runs)
  order: [],           // ids, in the order listed
  charts: new Map(),   // name -> Chart
  groups: new Map(),   // prefix -> {node, grid, count, n}
  columns: [],         // configuration keys that differ between the runs shown
  flat: new Map(),     // id -> {key: value} (its flattened configuration)
  runFilter: null, nameFilter: null,
};

function flatten(config, prefix, out) {
  if (config == null || typeof config !== "object" || Array.isArray(config)) {
    out[prefix] = Array.isArray(config) ? JSON.stringify(config) : config;
    return out;
  }
  for (const [k, v] of Object.entries(config)) flatten(v, prefix ? prefix + "." + k : k, out);
  return out;
}

function shownRuns() {
  return state.order.filter((id) => {
    const run = state.runs.get(id);
    return run && (!state.runFilter || state.runFilter.test(run.name));
  });
}

function colorOf(id) {
  const key = view.color;
  if (key && state.columns.includes(key)) {
    const values = [...new Set(shownRuns().map((r) => state.flat.get(r)[key]))];
    const numbers = values.filter((v) => typeof v === "number").sort((a, b) => a - b);
    const v = state.flat.get(id)[key];
    if (numbers.length === values.length && numbers.length > 1 && typeof v === "number") {
      const t = (v - numbers[0]) / (numbers[numbers.length - 1] - numbers[0]);
      return `hsl(${Math.round(240 - 240 * t)}, 70%, 42%)`;  // blue (low) to red (high)
    }
    return COLORS[values.indexOf(v) % COLORS.length];
  }
  return COLORS[state.order.indexOf(id) % COLORS.length];
}

// Runs whose configuration differs only by keys naming a seed: one group.
function groupsOf(ids) {
  const groups = new Map();
  for (const id of ids) {
    const flat = state.flat.get(id);
    const keys = Object.keys(flat).filter((k) => !/seed/i.test(k)).sort();
    const key = keys.length && view.group ? JSON.stringify(keys.map((k) => [k, flat[k]])) : id;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(id);
  }
  return [...groups.values()];
}

function setRuns(list) {
  const seen = new Set();
  for (const run of list) {
    state.runs.set(run.id, run);
    state.flat.set(run.id, flatten(run.config || {}, "", {}));
    if (!state.order.includes(run.id)) state.order.push(run.id);
    seen.add(run.id);
  }
  state.order = state.order.filter((id) => seen.has(id));
  refreshColumns();
  drawTable();
  ensureCharts();
  for (const chart of state.charts.values()) chart.stale = true;
  announce();
}

function refreshColumns() {
  const ids = shownRuns(), keys = new Set();
  for (const id of ids) for (const k of Object.keys(state.flat.get(id))) keys.add(k);
  state.columns = [...keys].filter((k) => {
    const values = new Set(ids.map((id) => JSON.stringify(state.flat.get(id)[k])));
    return values.size > 1;
  }).sort();
  const select = el("color-by"), current = view.color;
  select.replaceChildren(new Option("run", ""), ...state.columns.map((k) => new Option(k, k)));
  select.value = state.columns.includes(current) ? current : "";
}

function stateOf(run) { return run.live ? run.live.state : run.state; }

function drawTable() {
  const table = el("runs"), head = table.tHead.rows[0], body = table.tBodies[0];
  const fixed = [["", ""], ["run", "name"], ["state", "state"], ["points", "points"]];
  const columns = [...fixed, ...state.columns.map((k) => [k, "config:" + k])];
  head.replaceChildren(...columns.map(([title, key]) => {
    const th = document.createElement("th");
    th.textContent = title;
    th.dataset.key = key;
    if (key && view.sort === key) th.className = view.desc ? "sorted-desc" : "sorted-asc";
    if (key) th.onclick = () => {
      view.desc = view.sort === key ? !view.desc : false;
      view.sort = key;
      writeView();
      drawTable();
    };
    return th;
  }));
  const value = (id, key) => {
    const run = state.runs.get(id);
    if (key.startsWith("config:")) return state.flat.get(id)[key.slice(7)];
    return key === "state" ? stateOf(run) : run[key];
  };
  const ids = [...state.order];
  if (view.sort) {
    ids.sort((a, b) => {
      const x = value(a, view.sort), y = value(b, view.sort);
      const c = typeof x === "number" && typeof y === "number" ? x - y : String(x ?? "").localeCompare(String(y ?? ""));
      return view.desc ? -c : c;
    });
  }
  const rows = ids.map((id) => {
    const run = state.runs.get(id), tr = document.createElement("tr");
    tr.dataset.run = id;
    tr.dataset.state = stateOf(run);
    tr.classList.toggle("filtered", !!state.runFilter && !state.runFilter.test(run.name));
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = colorOf(id);
    const cells = [swatch, run.name, stateOf(run) + (run.live && run.live.detail ? ` (${run.live.detail})` : ""),
      run.points.toLocaleString("en-US"), ...state.columns.map((k) => {
        const v = state.flat.get(id)[k];
        return v === undefined ? "" : typeof v === "number" ? fmt(v, 6) : String(v);
      })];
    cells.forEach((c, i) => {
      const td = tr.insertCell();
      td.append(c);
      if (i === 1) td.title = run.source + (run.reason ? ` — ${run.reason}` : "");
      if (i === 2) td.className = "state-" + stateOf(run).split(" ")[0];
      if (i === 3) td.className = "num";
    });
    return tr;
  });
  body.replaceChildren(...rows);
}

function announce() {
  const live = state.order.map((id) => state.runs.get(id).live).filter(Boolean);
  document.dispatchEvent(new CustomEvent("loopbus:status", { detail: live }));
}

// ------------------------------------------------------------------ the charts
function epochStride(u, xs) {
  if (xs.length < 2) return 1;
  const px = xs.map((x) => u.valToPos(x, "x", true)).filter((x) => x >= u.bbox.left && x <= u.bbox.left + u.bbox.width);
  if (px.length < 2) return 1;
  const spacing = (px[px.length - 1] - px[0]) / (px.length - 1);
  return THIN.find((k) => k * Math.abs(spacing) >= MIN_MARKER_GAP * devicePixelRatio) || Infinity;
}

function markersPlugin(chart) {
  return { hooks: { draw: [(u) => {
    const ctx = u.ctx, top = u.bbox.top, bottom = top + u.bbox.height;
    const left = u.bbox.left, right = left + u.bbox.width;
    ctx.save();
    ctx.font = `${10 * devicePixelRatio}px system-ui, sans-serif`;
    const byRun = new Map();
    for (const m of chart.markers) {
      if (!byRun.has(m.run)) byRun.set(m.run, []);
      byRun.get(m.run).push(m);
    }
    let drawn = 0, labelled = new Map();
    for (const [run, list] of byRun) {
      const stride = epochStride(u, list.filter((m) => m.kind === "epoch").map((m) => m.x));
      let epoch = 0;
      for (const m of list) {
        if (m.kind === "epoch" && ++epoch % stride !== 0) continue;
        const x = Math.round(u.valToPos(m.x, "x", true));
        if (!(x >= left && x <= right)) continue;
        if (m.kind === "epoch") drawn++;
        const style = MARKER_STYLE[m.kind] || MARKER_STYLE.epoch;
        const color = m.kind === "stage" ? colorOf(run) : style.color;
        ctx.strokeStyle = color;
        ctx.lineWidth = style.width * devicePixelRatio;
        ctx.setLineDash(style.dash.map((d) => d * devicePixelRatio));
        ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, bottom); ctx.stroke();
        if (m.kind !== "epoch") {
          const slot = Math.round(x / (40 * devicePixelRatio)), n = labelled.get(slot) || 0;
          labelled.set(slot, n + 1);
          const width = ctx.measureText(m.label).width, pad = 3 * devicePixelRatio;
          ctx.fillStyle = color;
          ctx.fillText(m.label, x + pad + width > right ? x - pad - width : x + pad, top + (11 + 12 * n) * devicePixelRatio);
        }
      }
    }
    ctx.restore();
    chart.root.dataset.epochMarkers = String(drawn);
  }] } };
}

const sparse = (u, si, i0, i1) => {
  const ys = u.data[si];
  let n = 0;
  for (let i = i0; i <= i1 && n <= 64; i++) if (ys[i] != null) n++;
  return n <= 64;
};

class Chart {
  constructor(name) {
    this.name = name;
    this.plot = null;
    this.shape = "";
    this.stale = true;
    this.visible = !observer;  // until the observer says it is on screen
    this.busy = false;
    this.zoom = null;   // [lo, hi] of x, or null: everything
    this.markers = [];
    this.answer = null;
    this.lastLoad = 0;
    this.root = document.createElement("div");
    this.root.className = "chart";
    this.root.dataset.name = name;
    this.root.dataset.points = "0";
    this.root.dataset.series = "0";
    const header = document.createElement("header");
    const title = document.createElement("h3");
    title.textContent = name;
    this.count = document.createElement("span");
    this.count.className = "count";
    const csv = document.createElement("button");
    csv.type = "button";
    csv.className = "csv";
    csv.textContent = "CSV";
    csv.title = "every point of this chart's runs, as logged";
    csv.onclick = () => download({ runs: this.runs(), names: [name] }, name.replace(/[^\w.-]+/g, "_") + ".csv");
    header.append(title, this.count, csv);
    this.box = document.createElement("div");
    this.box.className = "plot";
    this.root.append(header, this.box);
  }
  runs() { return shownRuns().filter((id) => state.runs.get(id).names.includes(this.name)); }
  width() { return Math.max(200, this.box.clientWidth || 420); }
  async load() {
    if (this.busy) return;
    this.busy = true;
    this.stale = false;
    this.lastLoad = performance.now();
    try {
      const q = { runs: this.runs(), names: [this.name], x: view.x, width: Math.max(64, Math.round(this.width() - 60)) };
      if (this.zoom) [q.lo, q.hi] = this.zoom;
      if (view.smoothing > 0) q.smoothing = view.smoothing;  // of every point, not the drawn ones
      const answer = await api.lines(q);
      this.answer = answer;
      this.markers = answer.markers;
      this.draw();
    } catch (e) {
      this.count.textContent = String(e.message || e);
    } finally {
      this.busy = false;
    }
  }
  series() {  // [{label, color, ids}] drawn: a run, or a group of runs differing by seed
    const a = this.answer;
    return groupsOf(a.runs).map((ids) => {
      const first = state.runs.get(ids[0]);
      return { ids, color: colorOf(ids[0]), label: ids.length > 1 ? `${first.name} (+${ids.length - 1} seeds)` : first.name };
    });
  }
  data(series) {
    const a = this.answer, index = new Map(a.runs.map((id, i) => [id, i]));
    const clean = (ys) => (view.log ? ys.map((v) => (v > 0 ? v : null)) : ys);
    // The smoothed lines of every point, when the answer has them for this smoothing (a
    // moving average of the drawn points meanwhile: the page asks again).
    const full = view.smoothing > 0 && a.s && a.smoothing === view.smoothing;
    const columns = [a.x];
    for (const s of series) {
      const ys = s.ids.map((id) => clean(a.y[index.get(id)]));
      const ss = full ? s.ids.map((id) => clean(a.s[index.get(id)])) : null;
      if (ys.length === 1) {
        columns.push(ys[0]);
        if (view.smoothing > 0) columns.push(full ? ss[0] : ema(ys[0], view.smoothing));
        continue;
      }
      const lo = [], hi = [], mid = [], mean = (vs) => (vs.length ? vs.reduce((t, v) => t + v, 0) / vs.length : null);
      for (let i = 0; i < a.x.length; i++) {
        const vs = ys.map((y) => y[i]).filter((v) => v != null);
        lo.push(vs.length ? Math.min(...vs) : null);
        hi.push(vs.length ? Math.max(...vs) : null);
        mid.push(mean(full ? ss.map((y) => y[i]).filter((v) => v != null) : vs));
      }
      columns.push(view.smoothing > 0 && !full ? ema(mid, view.smoothing) : mid, lo, hi);
    }
    return columns;
  }
  options(series) {
    const smooth = view.smoothing > 0, value = (u, v) => fmt(v, 6);
    const out = [{ label: view.x, value: (u, v) => (v == null ? "–" : view.x === "wall" ? new Date(v * 1000).toLocaleString() : fmt(v, 8)) }];
    const bands = [];
    for (const s of series) {
      if (s.ids.length === 1) {
        out.push({ label: s.label + (smooth ? " (raw)" : ""), stroke: s.color, width: smooth ? 1 : 1.5, alpha: smooth ? 0.3 : 1, value, spanGaps: true, points: { size: 5, show: sparse } });
        if (smooth) out.push({ label: s.label, stroke: s.color, width: 1.75, value, spanGaps: true, points: { show: false } });
      } else {
        out.push({ label: s.label, stroke: s.color, width: 1.75, value, spanGaps: true, points: { show: false } });
        out.push({ label: s.label + " min", stroke: s.color, width: 0, alpha: 0.3, value, spanGaps: true, points: { show: false } });
        out.push({ label: s.label + " max", stroke: s.color, width: 0, alpha: 0.3, value, spanGaps: true, points: { show: false } });
        bands.push({ series: [out.length - 1, out.length - 2], fill: s.color + "33" });
      }
    }
    const a = this.answer;
    const y = view.log ? { distr: 3, log: 10 } : { auto: true };
    if (view.clip && a.p && a.p[1] > a.p[0] && !view.log) y.range = () => [a.p[0], a.p[1]];
    const xTitle = { step: "step", relative: "time since the run started (s)", wall: "wall time" }[view.x];
    return {
      width: this.width(), height: HEIGHT, series: out, bands,
      scales: { x: { time: view.x === "wall", ...(this.zoom ? { range: () => this.zoom } : {}) }, y },
      axes: [
        { label: xTitle, labelSize: 20, ...(view.x === "step" ? { incrs: THIN, values: (u, vals) => vals.map((v) => v.toLocaleString("en-US")) } : {}) },
        { label: this.name, values: (u, vals) => vals.map((v) => fmt(v, 4)), size: 60, labelSize: 20 },
      ],
      cursor: {
        sync: { key: "loopbus-" + view.x }, points: { size: 7 }, drag: { x: true, y: false, setScale: false },
        bind: { dblclick: () => () => { this.zoom = null; this.load(); return null; } },
      },
      hooks: { setSelect: [(u) => {
        if (u.select.width < 2) return;
        const lo = u.posToVal(u.select.left, "x"), hi = u.posToVal(u.select.left + u.select.width, "x");
        u.setSelect({ left: 0, width: 0, top: 0, height: 0 }, false);
        this.zoom = [lo, hi];
        this.load();
      }] },
      legend: { live: true },
      plugins: [markersPlugin(this)],
    };
  }
  draw() {
    const a = this.answer;
    if (!a) return;
    const series = this.series(), data = this.data(series);
    this.root.dataset.points = String(a.total);
    this.root.dataset.series = String(series.length);
    this.root.dataset.drawn = String(a.x.length);
    this.count.textContent = `${a.points.toLocaleString("en-US")} points` + (a.points !== a.total ? ` of ${a.total.toLocaleString("en-US")}` : "") + `, ${a.x.length.toLocaleString("en-US")} drawn`;
    const shape = JSON.stringify([series.map((s) => [s.label, s.color, s.ids.length]), view, this.zoom]);
    if (this.plot && shape === this.shape) this.plot.setData(data);
    else {
      if (this.plot) this.plot.destroy();
      this.shape = shape;
      this.plot = new uPlot(this.options(series), data, this.box);
    }
    if (this.plot.cursor.left == null || this.plot.cursor.left < 0) this.plot.setLegend({ idx: a.x.length - 1 });
    document.body.dataset.drawn = String(Number(document.body.dataset.drawn || 0) + 1);
  }
  resize() { if (this.plot) this.plot.setSize({ width: this.width(), height: HEIGHT }); }
}

function groupOf(name) {
  const cut = name.indexOf("/");
  return cut > 0 ? name.slice(0, cut) : "other";
}

function groupRank(group) {
  const i = GROUP_ORDER.indexOf(group);
  return i >= 0 ? String(i) : (group === "other" ? "~" : "5" + group);
}

function section(group) {
  let g = state.groups.get(group);
  if (g) return g;
  const node = document.createElement("section");
  node.className = "group";
  node.dataset.group = group;
  node.dataset.rank = groupRank(group);
  const heading = document.createElement("h2");
  heading.append(group === "other" ? "other" : group + "/*", " ");
  const count = document.createElement("small");
  heading.append(count);
  const grid = document.createElement("div");
  grid.className = "charts";
  node.append(heading, grid);
  const main = el("groups");
  const after = [...main.querySelectorAll("section.group")].find((s) => s.dataset.rank > node.dataset.rank);
  main.insertBefore(node, after || null);
  g = { node, grid, count, n: 0 };
  state.groups.set(group, g);
  return g;
}

const observer = "IntersectionObserver" in window ? new IntersectionObserver((entries) => {
  for (const e of entries) {
    const chart = state.charts.get(e.target.dataset.name);
    if (!chart) continue;
    chart.visible = e.isIntersecting;
    if (chart.visible && chart.stale) chart.load();
  }
}, { rootMargin: "200px" }) : null;

const resizer = "ResizeObserver" in window ? new ResizeObserver((entries) => {
  for (const e of entries) {
    const chart = state.charts.get(e.target.closest(".chart").dataset.name);
    if (chart) chart.resize();
  }
}) : null;

function ensureCharts() {
  const names = new Set();
  for (const id of shownRuns()) for (const n of state.runs.get(id).names) names.add(n);
  for (const name of names) {
    if (state.charts.has(name)) continue;
    const chart = new Chart(name);
    state.charts.set(name, chart);
    const g = section(groupOf(name));
    const after = [...g.grid.children].find((c) => c.dataset.name > name);
    g.grid.insertBefore(chart.root, after || null);
    g.n++;
    if (observer) observer.observe(chart.root);
    if (resizer) resizer.observe(chart.box);
  }
  for (const [name, chart] of state.charts) {
    const hidden = !names.has(name) || (!!state.nameFilter && !state.nameFilter.test(name));
    chart.root.classList.toggle("hidden", hidden);
  }
  for (const g of state.groups.values()) {
    const shown = g.grid.querySelectorAll(".chart:not(.hidden)").length;
    g.count.textContent = `(${shown} chart${shown === 1 ? "" : "s"})`;
    g.node.classList.toggle("hidden", shown === 0);
  }
  el("empty").classList.toggle("hidden", state.order.length > 0);
  el("empty").textContent = "No runs yet…";
}

function tick() {
  const now = performance.now();
  for (const chart of state.charts.values()) {
    if (chart.stale && chart.visible && !chart.root.classList.contains("hidden") && now - chart.lastLoad >= REFRESH_MS) chart.load();
  }
}

async function download(q, filename) {
  const text = await api.csv(q);
  const url = URL.createObjectURL(new Blob([text], { type: "text/csv" }));
  const a = document.createElement("a");
  a.href = url;
  a.download = filename;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// ------------------------------------------------------------------ updates and options
function onUpdate(message) {
  let added = message.count !== state.order.length;
  for (const run of message.runs) {
    const known = state.runs.get(run.id);
    if (!known) { added = true; continue; }
    Object.assign(known, run);
    for (const name of run.names) {
      const chart = state.charts.get(name);
      if (chart) chart.stale = true;
    }
  }
  if (added) { refresh(); return; }
  drawTable();
  ensureCharts();
  announce();
}

async function refresh() {
  try {
    setRuns(await api.runs());
  } catch (e) {
    el("connection").textContent = "dashboard unreachable, retrying…";
    el("connection").className = "connection down";
  }
}

function connect() {
  const connection = el("connection");
  if (OFFLINE) {
    connection.textContent = `report of ${new Date(OFFLINE.time * 1000).toLocaleString()}`;
    connection.className = "connection offline";
    return;
  }
  const source = new EventSource("api/updates");
  source.onopen = () => { connection.textContent = "live"; connection.className = "connection live"; };
  source.onerror = () => { connection.textContent = "dashboard unreachable, retrying…"; connection.className = "connection down"; };
  source.addEventListener("runs", (e) => onUpdate(JSON.parse(e.data)));
}

function applyView() {
  el("run-filter").value = view.runs;
  el("filter").value = view.names;
  el("x-axis").value = view.x;
  el("smoothing").value = String(view.smoothing);
  el("smoothing-value").textContent = view.smoothing > 0 ? view.smoothing.toFixed(2) : "off";
  el("log-scale").checked = view.log;
  el("clip").checked = view.clip;
  el("group-seeds").checked = view.group;
  state.runFilter = regex(view.runs, el("run-filter"));
  state.nameFilter = regex(view.names, el("filter"));
}

function changed(reload) {
  writeView();
  applyView();
  refreshColumns();
  el("color-by").value = view.color;
  drawTable();
  ensureCharts();
  for (const chart of state.charts.values()) {
    if (reload) { chart.zoom = null; chart.stale = true; } else chart.draw();
  }
  tick();
}

function options() {
  const on = (id, event, f) => el(id).addEventListener(event, f);
  on("run-filter", "input", (e) => { view.runs = e.target.value; changed(true); });
  on("filter", "input", (e) => { view.names = e.target.value; changed(false); });
  on("x-axis", "change", (e) => { view.x = e.target.value; changed(true); });
  on("smoothing", "input", (e) => {  // the smoothed lines are asked for again, the zoom kept
    view.smoothing = Number(e.target.value);
    for (const chart of state.charts.values()) chart.stale = true;
    changed(false);
  });
  on("log-scale", "change", (e) => { view.log = e.target.checked; changed(false); });
  on("clip", "change", (e) => { view.clip = e.target.checked; changed(false); });
  on("group-seeds", "change", (e) => { view.group = e.target.checked; changed(false); });
  on("color-by", "change", (e) => { view.color = e.target.value; changed(false); });
  on("download-all", "click", () => {
    const names = [...state.charts.values()].filter((c) => !c.root.classList.contains("hidden")).map((c) => c.name);
    download({ runs: shownRuns(), names }, "runs.csv");
  });
  window.addEventListener("hashchange", () => { readView(); changed(true); });
}

readView();
applyView();
options();
refresh().then(() => { ensureCharts(); tick(); });
connect();
setInterval(tick, 50);
window.loopbusDashboard = { state, view, api };
})();
