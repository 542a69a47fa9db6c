// advisor's web page: jobs, studies and one study's trials, read from the JSON API (/v1) and drawn as
// HTML tables and inline SVG. No framework, no library. Text from the API only ever enters the page as
// text nodes or attribute values (never innerHTML): workload and study names come from users.
"use strict";

const API = "v1"; // relative: resolves against the page, so a proxy prefix keeps working
const REFRESH_MS = 3000; // while a job is queued, running or cancelling
const RETRY_MS = 10000; // after a failed refresh
const STUDY_PAGE = 50;
const TRIAL_PAGE = 500; // the API's MAX_PAGE
const JOB_ACTIVE = new Set(["queued", "running", "cancelling"]);
const SVG_NS = "http://www.w3.org/2000/svg";
const MIB = 2 ** 20;
const GIB = 2 ** 30;

const PRECISION_COLORS = { fp32: "#1f77b4", tf32: "#17becf", bf16: "#ff7f0e", fp16: "#d62728", "bf16-pure": "#9467bd" };
const STATUS_COLORS = {
  ok: "#2ca02c", oom: "#d62728", timeout: "#ff7f0e", crashed: "#8c1c13", error: "#e377c2",
  invalid: "#7f7f7f", pruned: "#bcbd22", interrupted: "#8c564b", running: "#1f77b4",
};
const FALLBACK_COLORS = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"];

const state = { studyId: null, studyOffset: 0, studies: new Map(), timer: null, detailSeq: 0, errors: new Map() };

// ---- DOM -------------------------------------------------------------------------------------------

function build(el, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : String(c)); // a string becomes a text node: never parsed as markup
  }
  return el;
}
const h = (tag, attrs, ...children) => build(document.createElement(tag), attrs, children);
const s = (tag, attrs, ...children) => build(document.createElementNS(SVG_NS, tag), attrs, children);
const $ = (sel) => document.querySelector(sel);

function fill(sel, ...children) {
  const el = $(sel);
  el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}
const empty = (text) => h("p", { class: "empty" }, text);

function table(headers, rows) {
  return h("table", {},
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", { scope: "col" }, x)))),
    h("tbody", {}, rows));
}

// ---- formatting ------------------------------------------------------------------------------------

function fmtNum(x) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  const a = Math.abs(x);
  if (a >= 1e9) return (x / 1e9).toPrecision(3) + "G";
  if (a >= 1e6) return (x / 1e6).toPrecision(3) + "M";
  if (a >= 1e3) return (x / 1e3).toPrecision(3) + "k";
  if (a >= 100) return x.toFixed(0);
  return x.toPrecision(3);
}
// Axis ticks: short, no trailing zeros (0.5, not 0.500).
function fmtTick(v) {
  const a = Math.abs(v);
  const [div, suffix] = a >= 1e9 ? [1e9, "G"] : a >= 1e6 ? [1e6, "M"] : a >= 1e3 ? [1e3, "k"] : [1, ""];
  return String(+(v / div).toPrecision(6)) + suffix;
}
function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  return b >= GIB ? (b / GIB).toFixed(2) + " GiB" : (b / MIB).toFixed(1) + " MiB";
}
function fmtSeconds(sec) {
  if (sec === null || sec === undefined) return "–";
  return sec < 1 ? (sec * 1000).toPrecision(3) + " ms" : sec.toPrecision(3) + " s";
}
// The store writes UTC, but SQLite hands datetimes back without an offset: read one without as UTC.
const parseTime = (iso) => Date.parse(/([zZ]|[+-]\d\d:?\d\d)$/.test(iso) ? iso : `${iso}Z`); // ms since the epoch
function fmtTime(iso) {
  if (!iso) return "–";
  const d = new Date(parseTime(iso));
  return Number.isNaN(d.getTime()) ? String(iso) : d.toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" });
}
const badge = (status) => h("span", { class: `badge st-${String(status).replace(/[^a-z-]/g, "")}` }, status);

// Throughput of a trial (or a job's best): tokens/s where the workload counts tokens, else samples/s.
const rateKey = (r) => (r && r.tokens_per_s !== null && r.tokens_per_s !== undefined ? "tokens_per_s" : "samples_per_s");
const rate = (r) => (r ? r[rateKey(r)] : null);
const rateUnit = (key) => (key === "tokens_per_s" ? "tokens/s" : "samples/s");
const fmtRate = (r) => (rate(r) === null || rate(r) === undefined ? "–" : `${fmtNum(rate(r))} ${rateUnit(rateKey(r))}`);

function knobs(c) {
  c = c || {};
  return {
    batch: c.batch_size ?? "–",
    accum: c.grad_accum ?? 1,
    precision: c.precision ?? "–",
    compile: c.compile_mode ?? "–",
    workers: c.num_workers ?? "–",
    strategy: c.nproc > 1 ? `${c.strategy} ×${c.nproc}` : (c.strategy ?? "–"),
  };
}
function knobSummary(c) {
  const k = knobs(c);
  return [`batch ${k.batch}${k.accum > 1 ? ` ×${k.accum}` : ""}`, k.precision, `compile ${k.compile}`,
    `${k.workers} workers`, k.strategy].join(" · ");
}
const KNOB_HEADERS = ["batch", "accum", "precision", "compile", "workers", "strategy"];
const knobCells = (c) => Object.values(knobs(c)).map((v) => h("td", {}, v));

// ---- API -------------------------------------------------------------------------------------------

// GET (or, with `body`, POST as JSON) /v1/<path>; a failure throws one line: method, path, status, detail.
async function callJSON(path, body) {
  const method = body === undefined ? "GET" : "POST";
  const init = { method, headers: { Accept: "application/json" } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let res;
  try {
    res = await fetch(`${API}/${path}`, init);
  } catch (e) {
    throw new Error(`${method} /${API}/${path}: cannot reach the server (${e.message})`);
  }
  if (!res.ok) {
    let detail = res.statusText;
    try {
      const err = await res.json();
      if (err && err.detail !== undefined) detail = typeof err.detail === "string" ? err.detail : JSON.stringify(err.detail);
    } catch { /* the body is not JSON: keep the status text */ }
    throw new Error(`${method} /${API}/${path}: ${res.status} ${detail}`);
  }
  return res.json();
}
const getJSON = (path) => callJSON(path);

// One message per source (jobs, studies, study), so a later success clears only its own.
function setError(source, err) {
  if (err) state.errors.set(source, err.message || String(err));
  else state.errors.delete(source);
  const box = fill("#error", [...state.errors.values()].map((m) => h("div", {}, m)));
  box.hidden = state.errors.size === 0;
}

// Runs a loader; on failure the message goes to #error and `onFail` clears what would be stale.
async function guarded(source, fn, onFail) {
  try {
    const out = await fn();
    setError(source, null);
    return out;
  } catch (err) {
    setError(source, err);
    if (onFail) onFail();
    return undefined;
  }
}
const notLoaded = (sel) => () => fill(sel, empty("not loaded: see the error above"));
const hideDetail = () => { $("#study-detail").hidden = true; };

// ---- jobs ------------------------------------------------------------------------------------------

function progressBar(p) {
  const pct = Math.round(100 * (p.fraction || 0));
  return h("div", { class: "progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": pct },
    h("div", { class: "progress-fill", style: `width: ${pct}%` }),
    h("span", { class: "progress-text" }, `${p.done}/${p.total} trials`));
}

function jobCard(job) {
  const r = job.request || {};
  const study = job.study_id === null || job.study_id === undefined ? null
    : h("a", { href: `#study=${job.study_id}`, onclick: (e) => { e.preventDefault(); selectStudy(job.study_id); } },
      job.study_name || `study ${job.study_id}`);
  const best = job.best
    ? h("div", { class: "best" }, "best so far: ", h("strong", {}, fmtRate(job.best)),
      ` · ${fmtBytes(job.best.peak_memory_bytes)} · trial ${job.best.trial_id} · ${knobSummary(job.best.config)}`)
    : h("div", { class: "best muted" }, "no measured trial yet");
  return h("article", { class: "job", "data-job-id": job.id, "data-status": job.status },
    h("div", { class: "job-head" }, badge(job.status), h("code", {}, job.id.slice(0, 12)),
      h("span", {}, `${r.workload ?? "?"} on ${r.hardware ?? "?"} · space ${r.space ?? "?"}`),
      study ? h("span", {}, "→ ", study) : null,
      h("span", { class: "muted" }, fmtTime(job.created_at))),
    progressBar(job.progress), best,
    job.error ? h("pre", { class: "job-error" }, job.error) : null);
}

async function loadJobs() {
  const page = await getJSON("jobs?limit=20&offset=0");
  fill("#jobs", page.items.length ? page.items.map(jobCard)
    : empty("no jobs yet: queue one with POST /v1/tune or run `advisor tune`"));
  return page.items;
}

// ---- studies ---------------------------------------------------------------------------------------

function countsText(counts) {
  const parts = Object.entries(counts || {}).sort((a, b) => b[1] - a[1]).map(([st, n]) => `${st} ${n}`);
  return parts.length ? parts.join(" · ") : "none";
}

function studyRow(st) {
  // The link gives keyboard access; its click bubbles to the row, which selects.
  return h("tr", { "data-study-id": st.id, class: st.id === state.studyId ? "selected" : null, onclick: () => selectStudy(st.id) },
    h("td", { class: "wrap" }, h("a", { href: `#study=${st.id}`, onclick: (e) => e.preventDefault() }, st.name)),
    h("td", {}, st.workload_name), h("td", {}, st.hardware_name), h("td", {}, badge(st.status)),
    h("td", { class: "wrap" }, countsText(st.trial_counts)), h("td", { class: "num" }, fmtRate(st.best)),
    h("td", { class: "muted" }, fmtTime(st.created_at)));
}

function pager(total) {
  if (total <= STUDY_PAGE) return null;
  const go = (offset) => { state.studyOffset = offset; guarded("studies", loadStudies, notLoaded("#studies")); };
  const off = state.studyOffset;
  return h("div", { class: "pager" },
    h("button", { type: "button", disabled: off === 0, onclick: () => go(Math.max(0, off - STUDY_PAGE)) }, "← newer"),
    h("span", {}, `${off + 1}–${Math.min(total, off + STUDY_PAGE)} of ${total}`),
    h("button", { type: "button", disabled: off + STUDY_PAGE >= total, onclick: () => go(off + STUDY_PAGE) }, "older →"));
}

async function loadStudies() {
  const page = await getJSON(`studies?limit=${STUDY_PAGE}&offset=${state.studyOffset}`);
  state.studies = new Map(page.items.map((st) => [st.id, st]));
  fill("#studies", page.items.length
    ? [table(["name", "workload", "hardware", "status", "trials by status", "best throughput", "created"], page.items.map(studyRow)),
      pager(page.total)]
    : empty("no studies yet"));
  return page.items;
}

function selectStudy(id) {
  state.studyId = id;
  history.replaceState(null, "", `#study=${id}`);
  document.querySelectorAll("#studies tr[data-study-id]").forEach((tr) => tr.classList.toggle("selected", Number(tr.dataset.studyId) === id));
  return guarded("study", () => loadStudy(id), hideDetail);
}

// ---- one study -------------------------------------------------------------------------------------

async function loadStudy(id) {
  const seq = ++state.detailSeq; // a later click wins over an earlier, slower answer
  const [study, page] = await Promise.all([
    state.studies.get(id) || getJSON(`studies/${id}`), getJSON(`studies/${id}/trials?limit=${TRIAL_PAGE}&offset=0`)]);
  if (seq !== state.detailSeq) return;
  renderStudy(study, page);
}

function renderStudy(study, page) {
  const trials = page.items;
  const key = trials.some((t) => t.status === "ok" && t.tokens_per_s !== null && t.tokens_per_s !== undefined)
    ? "tokens_per_s" : "samples_per_s";
  const measured = trials.filter((t) => t.status === "ok" && t[key] !== null && t[key] !== undefined);
  const detail = $("#study-detail");
  fill("#study-title", `Study: ${study.name}`);
  fill("#study-meta", `${study.workload_name} on ${study.hardware_name} · objective ${study.objective} · ${study.status} · `
    + `created ${fmtTime(study.created_at)} · ${countsText(study.trial_counts)}`
    + (page.total > trials.length ? ` · showing the first ${trials.length} of ${page.total} trials` : ""));
  fill("#plot-throughput-batch", plotThroughputBatch(measured, key));
  fill("#plot-pareto", plotPareto(measured.filter((t) => t.peak_memory_bytes !== null && t.peak_memory_bytes !== undefined), key));
  fill("#plot-timeline", plotTimeline(trials.filter((t) => t.finished_at)));
  fill("#best-configs", bestTable(measured, key));
  fill("#trials", trialsTable(trials, key));
  detail.dataset.studyId = study.id; // set last: tests wait on it
  detail.hidden = false;
}

function bestTable(measured, key) {
  if (!measured.length) return empty("no measured trials yet");
  const top = [...measured].sort((a, b) => b[key] - a[key]).slice(0, 5);
  return table(["#", "trial", rateUnit(key), ...KNOB_HEADERS, "peak memory", "p50 step"], top.map((t, i) =>
    h("tr", { "data-trial-id": t.id }, h("td", {}, i + 1), h("td", { title: JSON.stringify(t.config) }, t.id),
      h("td", { class: "num" }, fmtNum(t[key])), knobCells(t.config),
      h("td", { class: "num" }, fmtBytes(t.peak_memory_bytes)), h("td", { class: "num" }, fmtSeconds(t.step_p50_s)))));
}

function trialsTable(trials, key) {
  if (!trials.length) return empty("no trials yet");
  return table(["trial", "status", ...KNOB_HEADERS, rateUnit(key), "peak memory", "p50 step", "bottleneck / error"],
    trials.map((t) => {
      const note = t.status === "ok" ? (t.bottleneck || "–") : (t.error || "").split("\n")[0].slice(0, 120) || "–";
      return h("tr", { "data-trial-id": t.id, "data-status": t.status },
        h("td", { title: JSON.stringify(t.config) }, t.id), h("td", {}, badge(t.status)), knobCells(t.config),
        h("td", { class: "num" }, fmtNum(t[key])), h("td", { class: "num" }, fmtBytes(t.peak_memory_bytes)),
        h("td", { class: "num" }, fmtSeconds(t.step_p50_s)), h("td", { class: "note", title: t.error || null }, note));
    }));
}

// ---- plots: inline SVG -----------------------------------------------------------------------------

const W = 520, H = 330;
const M = { l: 64, r: 16, t: 34, b: 46 }; // margins (px of the viewBox); the legend sits in the top one

function niceTicks(lo, hi, count = 5) {
  if (!(hi > lo)) hi = lo + (lo === 0 ? 1 : Math.abs(lo));
  const raw = (hi - lo) / count, mag = 10 ** Math.floor(Math.log10(raw)), n = raw / mag;
  const step = (n <= 1 ? 1 : n <= 2 ? 2 : n <= 5 ? 5 : 10) * mag;
  const ticks = [];
  for (let v = Math.floor(lo / step) * step; v <= Math.ceil(hi / step) * step + step / 2; v += step) ticks.push(+v.toPrecision(12));
  return ticks;
}
// A map from [d0, d1] to [r0, r1]; `log` maps log2 of the value.
function scale(d0, d1, r0, r1, log = false) {
  const f = log ? Math.log2 : (v) => v;
  const a = f(d0), b = f(d1), k = b === a ? 0 : (r1 - r0) / (b - a);
  return (v) => (b === a ? (r0 + r1) / 2 : r0 + (f(v) - a) * k);
}

function frame(width, height, label) {
  return s("svg", { viewBox: `0 0 ${width} ${height}`, width: "100%", role: "img", "aria-label": label, class: "chart" });
}

// Grid, ticks and axis labels for a plot area [M.l, w - M.r] x [M.t, h - M.b].
function axes(svg, o) {
  const [w, hgt] = [o.width, o.height];
  const g = s("g", { class: "axes" });
  for (const v of o.yTicks || []) {
    const y = o.y(v);
    g.append(s("line", { x1: M.l, x2: w - M.r, y1: y, y2: y, class: "grid" }),
      s("text", { x: M.l - 6, y: y + 4, "text-anchor": "end" }, o.yFmt(v)));
  }
  for (const v of o.xTicks) {
    const x = o.x(v);
    g.append(s("line", { x1: x, x2: x, y1: hgt - M.b, y2: hgt - M.b + 5, class: "tick" }),
      s("text", { x, y: hgt - M.b + 18, "text-anchor": "middle" }, o.xFmt(v)));
  }
  g.append(s("line", { x1: M.l, x2: w - M.r, y1: hgt - M.b, y2: hgt - M.b, class: "axis" }),
    s("line", { x1: M.l, x2: M.l, y1: M.t, y2: hgt - M.b, class: "axis" }),
    s("text", { x: (M.l + w - M.r) / 2, y: hgt - 6, "text-anchor": "middle", class: "label" }, o.xLabel),
    s("text", { transform: `translate(14 ${(M.t + hgt - M.b) / 2}) rotate(-90)`, "text-anchor": "middle", class: "label" }, o.yLabel));
  svg.append(g);
}

// A row of swatches in the top margin. entries: [[text, colour, shape]]; shape "line" for the Pareto step.
function legend(svg, entries) {
  let x = M.l;
  const g = s("g", { class: "legend" });
  for (const [text, color, shape] of entries) {
    g.append(shape === "line"
      ? s("line", { x1: x, x2: x + 14, y1: 14, y2: 14, stroke: color, "stroke-width": 2 })
      : s("rect", { x, y: 8, width: 12, height: 12, rx: 2, fill: color }),
    s("text", { x: x + 18, y: 18 }, text));
    x += 30 + 7 * String(text).length; // ~7 px a character at 12 px
  }
  svg.append(g);
}

function colorFor(map, key, seen) {
  if (map[key]) return map[key];
  if (!seen.has(key)) seen.set(key, FALLBACK_COLORS[seen.size % FALLBACK_COLORS.length]);
  return seen.get(key);
}

const tip = (t, key) => s("title", {}, `trial ${t.id} · ${t.status} · ${knobSummary(t.config)}`
  + (t[key] !== null && t[key] !== undefined ? ` — ${fmtNum(t[key])} ${rateUnit(key)}` : "")
  + (t.peak_memory_bytes ? ` · ${fmtBytes(t.peak_memory_bytes)}` : ""));

function rateAxis(measured, key) {
  const ticks = niceTicks(0, Math.max(...measured.map((t) => t[key])));
  return { ticks, y: scale(0, ticks.at(-1), H - M.b, M.t) };
}

function plotThroughputBatch(measured, key) {
  const pts = measured.filter((t) => t.config && t.config.batch_size > 0);
  if (!pts.length) return empty("no measured trials yet");
  const batches = [...new Set(pts.map((t) => t.config.batch_size))].sort((a, b) => a - b);
  const lo = batches[0], hi = batches.at(-1);
  // Batch sizes are mostly powers of two: a log2 axis spaces them evenly.
  const xTicks = batches.length <= 10 ? batches
    : niceTicks(Math.log2(lo), Math.log2(hi)).filter(Number.isInteger).map((e) => 2 ** e).filter((v) => v >= lo && v <= hi);
  const pad = lo === hi ? 1 : 0.25; // in log2 units, so points clear the axes
  const x = scale(lo / 2 ** pad, hi * 2 ** pad, M.l, W - M.r, true);
  const { ticks, y } = rateAxis(pts, key);
  const svg = frame(W, H, `${rateUnit(key)} against batch size, by precision`);
  axes(svg, { width: W, height: H, x, y, xTicks, yTicks: ticks, xFmt: String, yFmt: fmtTick,
    xLabel: "batch size per device (log scale)", yLabel: rateUnit(key) });
  const seen = new Map(), byPrecision = new Map();
  for (const t of pts) {
    const p = String(t.config.precision ?? "?");
    if (!byPrecision.has(p)) byPrecision.set(p, []);
    byPrecision.get(p).push(t);
  }
  for (const [p, ts] of byPrecision) {
    const color = colorFor(PRECISION_COLORS, p, seen);
    // A line through the best point at each batch size: the trend; every trial is still a point.
    const best = new Map();
    for (const t of ts) if (!best.has(t.config.batch_size) || best.get(t.config.batch_size)[key] < t[key]) best.set(t.config.batch_size, t);
    const line = [...best.values()].sort((a, b) => a.config.batch_size - b.config.batch_size);
    if (line.length > 1) svg.append(s("polyline", { points: line.map((t) => `${x(t.config.batch_size)},${y(t[key])}`).join(" "), stroke: color, class: "trend" }));
    for (const t of ts) svg.append(s("circle", { cx: x(t.config.batch_size), cy: y(t[key]), r: 4.5, fill: color, "data-trial-id": t.id, class: "pt" }, tip(t, key)));
  }
  legend(svg, [...byPrecision.keys()].map((p) => [p, colorFor(PRECISION_COLORS, p, seen)]));
  return svg;
}

// Trials no other trial beats on both axes (more throughput with no more memory), by memory ascending.
function paretoFront(pts, key) {
  const sorted = [...pts].sort((a, b) => a.peak_memory_bytes - b.peak_memory_bytes || b[key] - a[key]);
  const front = [];
  for (const t of sorted) if (!front.length || t[key] > front.at(-1)[key]) front.push(t);
  return front;
}

function plotPareto(pts, key) {
  if (!pts.length) return empty("no measured trials yet");
  const maxMem = Math.max(...pts.map((t) => t.peak_memory_bytes));
  const unit = maxMem >= GIB ? GIB : MIB, unitName = unit === GIB ? "GiB" : "MiB";
  const xTicks = niceTicks(0, maxMem / unit);
  const x = scale(0, xTicks.at(-1) * unit, M.l, W - M.r);
  const { ticks, y } = rateAxis(pts, key);
  const svg = frame(W, H, `${rateUnit(key)} against peak memory, with the Pareto front`);
  axes(svg, { width: W, height: H, x: (v) => x(v * unit), y, xTicks, yTicks: ticks, xFmt: fmtTick, yFmt: fmtTick,
    xLabel: `peak memory (${unitName})`, yLabel: rateUnit(key) });
  const front = paretoFront(pts, key);
  const onFront = new Set(front.map((t) => t.id));
  // The best throughput reachable within a memory budget: flat until the next front point, then up.
  let d = `M ${x(front[0].peak_memory_bytes)} ${y(front[0][key])}`;
  for (const t of front.slice(1)) d += ` H ${x(t.peak_memory_bytes)} V ${y(t[key])}`;
  svg.append(s("path", { d: d + ` H ${W - M.r}`, class: "front" }));
  for (const t of pts) {
    svg.append(s("circle", { cx: x(t.peak_memory_bytes), cy: y(t[key]), r: onFront.has(t.id) ? 5.5 : 4, "data-trial-id": t.id,
      class: onFront.has(t.id) ? "pt pareto" : "pt dominated", "data-pareto": onFront.has(t.id) }, tip(t, key)));
  }
  legend(svg, [["Pareto front", "#d62728", "line"], ["on the front", "#d62728"], ["dominated", "#9aa5b1"]]);
  return svg;
}

function plotTimeline(done) {
  if (!done.length) return empty("no finished trials yet");
  const rows = done.map((t) => ({ t, a: parseTime(t.started_at), b: parseTime(t.finished_at) }))
    .filter((r) => Number.isFinite(r.a) && Number.isFinite(r.b)).sort((p, q) => p.a - q.a || p.t.id - q.t.id);
  if (!rows.length) return empty("no finished trials yet");
  const t0 = rows[0].a, span = Math.max(...rows.map((r) => r.b)) - t0; // ms
  const [unit, unitName] = span >= 2 * 3600e3 ? [3600e3, "hours"] : span >= 120e3 ? [60e3, "minutes"] : [1e3, "seconds"];
  const width = 2 * W, rowH = Math.min(18, Math.max(1.5, 540 / rows.length)); // px a row; 500 trials stay on a screen
  const height = M.t + M.b + rows.length * rowH;
  const xTicks = niceTicks(0, span / unit);
  const x = scale(0, xTicks.at(-1) * unit, M.l, width - M.r);
  const svg = frame(width, height, "trials from start to finish, coloured by status");
  axes(svg, { width, height, x: (v) => x(v * unit), xTicks, xFmt: fmtTick, xLabel: `${unitName} since the first trial started`,
    yLabel: "trials" });
  const seen = new Map(), statuses = [];
  rows.forEach((r, i) => {
    const color = colorFor(STATUS_COLORS, r.t.status, seen);
    if (!statuses.includes(r.t.status)) statuses.push(r.t.status);
    const y0 = M.t + i * rowH;
    svg.append(s("rect", { x: x(r.a - t0), y: y0 + rowH * 0.15, width: Math.max(1.5, x(r.b - t0) - x(r.a - t0)),
      height: rowH * 0.7, fill: color, "data-trial-id": r.t.id, "data-status": r.t.status, class: "bar" },
    s("title", {}, `trial ${r.t.id} · ${r.t.status} · ${fmtSeconds((r.b - r.a) / 1000)} · ${knobSummary(r.t.config)}`)));
    if (rowH >= 11) svg.append(s("text", { x: M.l - 6, y: y0 + rowH * 0.5 + 4, "text-anchor": "end", class: "rowlabel" }, r.t.id));
  });
  legend(svg, statuses.map((st) => [st, colorFor(STATUS_COLORS, st, seen)]));
  return svg;
}

// ---- refresh loop ----------------------------------------------------------------------------------

async function refresh() {
  clearTimeout(state.timer);
  const jobs = await guarded("jobs", loadJobs, notLoaded("#jobs"));
  const studies = await guarded("studies", loadStudies, notLoaded("#studies"));
  if (state.studyId === null && studies && studies.length) {
    const newest = studies.reduce((a, b) => (parseTime(b.created_at) > parseTime(a.created_at) ? b : a));
    state.studyId = newest.id;
    document.querySelector(`#studies tr[data-study-id="${newest.id}"]`)?.classList.add("selected");
  }
  if (state.studyId !== null) await guarded("study", () => loadStudy(state.studyId), hideDetail);
  fill("#refreshed", `updated ${new Date().toLocaleTimeString()}`);
  const failed = jobs === undefined || studies === undefined;
  if (failed || jobs.some((j) => JOB_ACTIVE.has(j.status))) state.timer = setTimeout(refresh, failed ? RETRY_MS : REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  const m = /^#study=(\d+)$/.exec(location.hash);
  if (m) state.studyId = Number(m[1]);
  refresh();
});
