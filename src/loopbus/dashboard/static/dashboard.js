// The loopbus dashboard page: reads the dashboard's Server-Sent Events and charts every
// record name with uPlot, one chart per name, grouped by the name's prefix, one series
// per run, x = step.
//
// Messages (see loopbus/dashboard/_hub.py):
//   event "status": {"runs": [{run, label, address, state, detail, stage, step, epoch,
//                   records, gaps}], "time", "started"}
//   event "data":   {"id", "parts": [{"run": i, "records": {name: [[steps], [values]]},
//                   "markers": [{"kind": "epoch"|"stage"|"gap", "step", "label"}]}]}
//   event "forgotten": how many messages the dashboard no longer keeps (history limit),
//                   or skipped while this page lagged behind; the next message follows.
// The history arrives as many "data" messages (the dashboard sends them in bounded chunks,
// at the page's pace), then the live ones: each is handled alone, as it arrives.
// The page raises "loopbus:status" on document with the runs, for pages that add controls.
(() => {
"use strict";

const COLORS = ["#0969da", "#d1242f", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#bf3989", "#6e7781"];
const MAX_POINTS = 50000;   // per series; beyond it, every other point is kept
const REDRAW_MS = 250;      // charts are redrawn at most this often
const HEIGHT = 230;
const GROUP_ORDER = ["train", "val", "validate", "test", "predict"];
// Epoch-end markers closer than this (CSS pixels) are thinned out to every 2nd, 5th,
// 10th, ... epoch: drawn for every one of thousands of short epochs they would fill the
// chart as a grey band.
const MIN_MARKER_GAP = 8;
const MARKER_STYLE = {
  epoch: { color: "#8c959f", width: 1, dash: [4, 4] },
  stage: { color: "#8250df", width: 2, dash: [] },
  gap: { color: "#cf222e", width: 2, dash: [2, 2] },
};
// Integer steps on the x axis: 1, 2, 5, 10, 20, 50, ...
const STEP_INCRS = [];
for (let e = 0; e <= 12; e++) for (const m of [1, 2, 5]) STEP_INCRS.push(m * 10 ** e);

const el = (id) => document.getElementById(id);
const script = document.currentScript;

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

class Series {
  constructor() { this.x = []; this.y = []; this.stride = 1; this.phase = 0; this.count = 0; }
  push(steps, values) {
    const x = this.x, y = this.y;
    this.count += steps.length;
    for (let i = 0; i < steps.length; i++) {
      if (this.stride > 1 && (this.phase++ % this.stride) !== 0) continue;
      x.push(steps[i]);
      y.push(values[i]);
    }
    if (x.length > MAX_POINTS) {  // keep memory and drawing bounded on long runs
      this.x = x.filter((_, i) => i % 2 === 0);
      this.y = y.filter((_, i) => i % 2 === 0);
      this.stride *= 2;
    }
  }
}

const state = {
  runs: [],          // status of each run, by index
  markers: [],       // per run: [{kind, step, label}]
  charts: new Map(), // name -> Chart
  groups: new Map(), // prefix -> {section, grid, count}
  smoothing: 0,
  log: false,
  filter: "",
  records: 0,
  counts: { epoch: 0, stage: 0, gap: 0 },  // markers received, by kind
  started: null,
  source: null,
};

const colorOf = (run) => COLORS[run % COLORS.length];
const labelOf = (run) => (state.runs[run] && state.runs[run].label) || ("run " + run);

// Every how many epoch markers one is drawn, so that those drawn are at least
// MIN_MARKER_GAP pixels apart: 1, 2, 5, 10, 20, ... (a round number of epochs).
function epochStride(u, markers) {
  let n = 0, first = null, last = null;
  for (const m of markers) {
    if (m.kind !== "epoch") continue;
    const x = u.valToPos(m.step, "x", true);
    if (!(x >= u.bbox.left && x <= u.bbox.left + u.bbox.width)) continue;
    n++;
    if (first === null) first = x;
    last = x;
  }
  if (n < 2) return 1;
  const spacing = (last - first) / (n - 1);
  const gap = MIN_MARKER_GAP * devicePixelRatio;
  return STEP_INCRS.find((k) => k * spacing >= gap) || Infinity;
}

function markersPlugin() {
  return {
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx, top = u.bbox.top, bottom = top + u.bbox.height;
        const left = u.bbox.left, right = left + u.bbox.width;
        ctx.save();
        ctx.font = `${10 * devicePixelRatio}px system-ui, sans-serif`;
        const labelled = new Map();  // x -> labels drawn there, to stack them
        let epochsDrawn = 0;
        for (let run = 0; run < state.markers.length; run++) {
          const markers = state.markers[run] || [];
          const stride = epochStride(u, markers);
          let epoch = 0;  // the index of this run's epoch marker
          for (const m of markers) {
            if (m.kind === "epoch" && ++epoch % stride !== 0) continue;
            const x = Math.round(u.valToPos(m.step, "x", true));
            if (!(x >= left && x <= right)) continue;
            if (m.kind === "epoch") epochsDrawn++;
            const style = MARKER_STYLE[m.kind] || MARKER_STYLE.epoch;
            const color = m.kind === "stage" ? colorOf(run) : style.color;
            ctx.strokeStyle = color;
            ctx.lineWidth = style.width * devicePixelRatio;
            ctx.setLineDash(style.dash.map((d) => d * devicePixelRatio));
            ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, bottom); ctx.stroke();
            if (m.kind !== "epoch") {
              const slot = Math.round(x / (40 * devicePixelRatio));
              const n = labelled.get(slot) || 0;
              labelled.set(slot, n + 1);
              const text = m.label;
              const width = ctx.measureText(text).width;
              const tx = x + 3 * devicePixelRatio + width > right ? x - 3 * devicePixelRatio - width : x + 3 * devicePixelRatio;
              ctx.fillStyle = color;
              ctx.fillText(text, tx, top + (11 + 12 * n) * devicePixelRatio);
            }
          }
        }
        ctx.restore();
        const chart = u.root.closest(".chart");
        if (chart) chart.dataset.epochMarkers = String(epochsDrawn);
      }],
    },
  };
}

// Points are drawn where a series has few of them (a few test records at one step).
const sparse = (u, si, i0, i1) => {
  const ys = u.data[si];
  let n = 0;
  for (let i = i0; i <= i1 && n <= 64; i++) if (ys[i] != null) n++;
  return n <= 64;
};

class Chart {
  constructor(name) {
    this.name = name;
    this.series = [];  // per run index
    this.plot = null;
    this.shape = "";
    this.dirty = true;
    this.visible = true;
    this.root = document.createElement("div");
    this.root.className = "chart";
    this.root.dataset.name = name;
    this.root.dataset.points = "0";
    const title = document.createElement("h3");
    title.textContent = name;
    this.box = document.createElement("div");
    this.box.className = "plot";
    this.root.append(title, this.box);
  }
  add(run, steps, values) {
    let s = this.series[run];
    if (!s) s = this.series[run] = new Series();
    s.push(steps, values);
    this.dirty = true;
  }
  points() { return this.series.reduce((n, s) => n + (s ? s.count : 0), 0); }
  runs() { return this.series.map((s, i) => (s ? i : -1)).filter((i) => i >= 0); }
  options(runs) {
    const smooth = state.smoothing > 0;
    const series = [{ label: "step", value: (u, v) => (v == null ? "–" : String(v)) }];
    for (const run of runs) {
      const color = colorOf(run);
      const value = (u, v) => fmt(v, 6);
      series.push({
        label: labelOf(run) + (smooth ? " (raw)" : ""), stroke: color, width: smooth ? 1 : 1.5,
        alpha: smooth ? 0.3 : 1, value, points: { size: 5, show: sparse },
      });
      if (smooth) series.push({ label: labelOf(run), stroke: color, width: 1.75, value, points: { show: false } });
    }
    return {
      width: Math.max(200, this.box.clientWidth || 420), height: HEIGHT,
      series,
      scales: { x: { time: false }, y: state.log ? { distr: 3, log: 10 } : { auto: true } },
      axes: [
        { label: "step", incrs: STEP_INCRS, values: (u, vals) => vals.map((v) => v.toLocaleString("en-US")), labelSize: 20 },
        { label: this.name, values: (u, vals) => vals.map((v) => fmt(v, 4)), size: 60, labelSize: 20 },
      ],
      cursor: { sync: { key: "loopbus" }, points: { size: 7 } },
      legend: { live: true },
      plugins: [markersPlugin()],
    };
  }
  data(runs) {
    const smooth = state.smoothing > 0;
    const tables = runs.map((run) => {
      const s = this.series[run];
      let ys = s.y;
      if (state.log) ys = ys.map((v) => (v > 0 ? v : null));
      return smooth ? [s.x, ys, ema(ys, state.smoothing)] : [s.x, ys];
    });
    if (tables.length === 1) return tables[0];
    return uPlot.join(tables, tables.map((t) => t.slice(1).map(() => 1)));  // keep real gaps
  }
  draw() {
    this.root.dataset.points = String(this.points());
    if (!this.visible || this.root.classList.contains("hidden")) return;
    const runs = this.runs();
    const shape = [runs.join(","), state.smoothing > 0, state.log, runs.map(labelOf).join("|")].join(";");
    const data = this.data(runs);
    if (this.plot && shape === this.shape) {
      this.plot.setData(data);
    } else {
      if (this.plot) this.plot.destroy();
      this.shape = shape;
      this.plot = new uPlot(this.options(runs), data, this.box);
    }
    const cursor = this.plot.cursor;
    if (cursor.left == null || cursor.left < 0) {  // not hovered: the legend shows the latest
      this.plot.setLegend({ idx: data[0].length - 1 });
    }
    this.dirty = false;
  }
  resize() {
    if (this.plot) this.plot.setSize({ width: Math.max(200, this.box.clientWidth), height: HEIGHT });
  }
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
  heading.innerHTML = "";
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
  el("empty").classList.add("hidden");
  return g;
}

const observer = "IntersectionObserver" in window ? new IntersectionObserver((entries) => {
  for (const e of entries) {
    const chart = state.charts.get(e.target.dataset.name);
    if (!chart) continue;
    chart.visible = e.isIntersecting;
    if (chart.visible && chart.dirty) chart.draw();
  }
}, { rootMargin: "200px" }) : null;

const resizer = "ResizeObserver" in window ? new ResizeObserver((entries) => {
  for (const e of entries) {
    const chart = state.charts.get(e.target.closest(".chart").dataset.name);
    if (chart) chart.resize();
  }
}) : null;

function chartFor(name) {
  let chart = state.charts.get(name);
  if (chart) return chart;
  chart = new Chart(name);
  state.charts.set(name, chart);
  const g = section(groupOf(name));
  const after = [...g.grid.children].find((c) => c.dataset.name > name);
  g.grid.insertBefore(chart.root, after || null);
  g.n++;
  g.count.textContent = `(${g.n} chart${g.n === 1 ? "" : "s"})`;
  applyFilter(chart);
  if (observer) observer.observe(chart.root);
  if (resizer) resizer.observe(chart.box);
  return chart;
}

function onData(message) {
  for (const part of message.parts) {
    const run = part.run;
    for (const [name, [steps, values]] of Object.entries(part.records)) {
      chartFor(name).add(run, steps, values);
      state.records += steps.length;
    }
    if (part.markers.length) {
      const list = (state.markers[run] = state.markers[run] || []);
      for (const m of part.markers) {  // one at a time: a long history is many of them
        list.push(m);
        state.counts[m.kind] = (state.counts[m.kind] || 0) + 1;
      }
      for (const chart of state.charts.values()) chart.dirty = true;
    }
  }
  document.body.dataset.records = String(state.records);
  const counts = state.counts;
  document.body.dataset.epochs = String(counts.epoch);
  document.body.dataset.stages = String(counts.stage);
  document.body.dataset.gaps = String(counts.gap);
}

function onStatus(status) {
  if (state.started !== null && status.started !== state.started) {
    reset();  // the dashboard restarted: its history is a new one
  }
  state.started = status.started;
  const relabel = status.runs.some((r, i) => !state.runs[i] || state.runs[i].label !== r.label);
  state.runs = status.runs;
  const body = el("runs").tBodies[0];
  for (const run of status.runs) {
    let row = body.rows[run.run];
    if (!row) {
      row = body.insertRow();
      for (let i = 0; i < 8; i++) row.insertCell();
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = colorOf(run.run);
      row.cells[0].append(swatch);
      for (const i of [4, 5, 6, 7]) row.cells[i].className = "num";
    }
    row.dataset.run = String(run.run);
    row.dataset.state = run.state;
    row.cells[1].textContent = run.label;
    row.cells[1].title = run.address;
    row.cells[2].textContent = run.state;
    row.cells[2].className = "state-" + run.state.split(" ")[0];
    row.cells[3].textContent = run.detail;
    row.cells[4].textContent = run.step.toLocaleString("en-US");
    row.cells[5].textContent = String(run.epoch);
    row.cells[6].textContent = run.records.toLocaleString("en-US");
    row.cells[7].textContent = run.gaps ? run.gaps.toLocaleString("en-US") : "0";
  }
  if (relabel) for (const chart of state.charts.values()) chart.dirty = true;
  document.dispatchEvent(new CustomEvent("loopbus:status", { detail: status.runs }));
}

function reset() {
  for (const chart of state.charts.values()) if (chart.plot) chart.plot.destroy();
  state.charts.clear();
  state.groups.clear();
  state.markers = [];
  state.records = 0;
  state.counts = { epoch: 0, stage: 0, gap: 0 };
  el("groups").querySelectorAll("section.group").forEach((s) => s.remove());
  el("empty").classList.remove("hidden");
  if (state.source) { state.source.close(); connect(); }
}

function applyFilter(chart) {
  const f = state.filter;
  chart.root.classList.toggle("hidden", f !== "" && !chart.name.includes(f));
}

function redraw() {
  for (const chart of state.charts.values()) if (chart.dirty) chart.draw();
}

function connect() {
  const connection = el("connection");
  const source = new EventSource(script.dataset.events || "events");
  state.source = source;
  source.onopen = () => { connection.textContent = "live"; connection.className = "connection live"; };
  source.onerror = () => { connection.textContent = "dashboard unreachable, retrying…"; connection.className = "connection down"; };
  source.addEventListener("status", (e) => onStatus(JSON.parse(e.data)));
  source.addEventListener("data", (e) => onData(JSON.parse(e.data)));
  source.addEventListener("forgotten", (e) => {
    connection.textContent = `live (the oldest ${e.data} messages are no longer kept)`;
  });
}

function options() {
  const slider = el("smoothing");
  slider.addEventListener("input", () => {
    state.smoothing = Number(slider.value);
    el("smoothing-value").textContent = state.smoothing > 0 ? state.smoothing.toFixed(2) : "off";
    for (const chart of state.charts.values()) chart.dirty = true;
    redraw();
  });
  el("log-scale").addEventListener("change", (e) => {
    state.log = e.target.checked;
    for (const chart of state.charts.values()) chart.dirty = true;
    redraw();
  });
  el("filter").addEventListener("input", (e) => {
    state.filter = e.target.value.trim();
    for (const chart of state.charts.values()) { applyFilter(chart); chart.dirty = true; }
    redraw();
  });
}

options();
connect();
setInterval(redraw, REDRAW_MS);
window.loopbusDashboard = { state, reset };
})();
