// advisor's plan view: a form that POSTs /v1/plan, the plans as a table, and per plan two stacked bars (memory by
// part against the usable memory, the step's time by part). Uses app.js's helpers (h, s, fill, table, callJSON,
// the formatters); text from the API enters the page only as text nodes or attribute values.
"use strict";

const MEMORY_PARTS = [
  ["parameters", "#1f77b4"], ["gradients", "#ff7f0e"], ["optimizer_state", "#2ca02c"], ["activations", "#d62728"],
  ["temporaries", "#9467bd"], ["overhead", "#8c564b"], ["runtime", "#7f7f7f"], ["nccl", "#bcbd22"],
];
const TIME_PARTS = [
  ["compute_s", "compute", "#2563eb"], ["exposed_comm_s", "exposed comm", "#f59e0b"], ["bubble_s", "bubble", "#9aa5b1"],
  ["optimizer_s", "optimizer", "#10b981"],
];
const BAR_W = 420, BAR_H = 18; // px of a bar's viewBox
const plan = { loaded: false, seq: 0 };
const VIEWS = ["tune", "plan", "estimate"];

// ---- the view --------------------------------------------------------------------------------------

// Shows one view (its tab pressed), hides the others; the Estimate view keeps its own hash (estimate.js).
function showView(which) {
  for (const view of VIEWS) {
    $(`#${view}-view`).hidden = view !== which;
    $(`#tab-${view}`).setAttribute("aria-pressed", String(view === which));
  }
  if (which === "plan") {
    history.replaceState(null, "", "#plan");
    if (!plan.loaded) loadPlanChoices();
  } else if (which === "tune" && /^#(plan|estimate)\b/.test(location.hash)) {
    history.replaceState(null, "", location.pathname + location.search);
  }
}

// The presets for the workload menu and the catalog's names for the hardware field, once.
async function loadPlanChoices() {
  plan.loaded = true;
  try {
    const [workloads, hardware] = await Promise.all([getJSON("workloads"), getJSON("hardware")]);
    const select = $("#plan-workload");
    const current = select.value || "llama-8b";
    fill("#plan-workload", workloads.map((w) => h("option", { value: w.name, title: w.description || null }, w.name)));
    select.value = workloads.some((w) => w.name === current) ? current : workloads[0]?.name;
    fill("#plan-hardware-names", hardware.filter((hw) => hw.spec.vendor !== "cpu")
      .map((hw) => h("option", { value: `${hw.name}:8` })));
    planError(null);
  } catch (err) {
    plan.loaded = false;
    planError(err);
  }
}

function planError(err) {
  const box = fill("#plan-error", err ? (err.message || String(err)) : null);
  box.hidden = !err;
}

// ---- the form --------------------------------------------------------------------------------------

// "a=1 b=x, c=true" -> {a: 1, b: "x", c: true}: a value is read as JSON where it is (numbers, booleans, null).
function parsePairs(text, what) {
  const out = {};
  for (const pair of text.split(/[\s,]+/).filter(Boolean)) {
    const i = pair.indexOf("=");
    if (i <= 0 || i === pair.length - 1) throw new Error(`${what}: ${JSON.stringify(pair)} is not KEY=VALUE`);
    const raw = pair.slice(i + 1);
    let value = raw;
    try { value = JSON.parse(raw); } catch { /* a bare word: a string */ }
    out[pair.slice(0, i)] = value;
  }
  return out;
}

// "4" -> [4, 4]; "1-16" -> [1, 16]; "" -> null. The API says what is wrong with a range.
function parseNodes(text) {
  const t = text.trim();
  if (!t) return null;
  const m = /^(\d+)(?:\s*-\s*(\d+))?$/.exec(t);
  if (!m) throw new Error(`nodes: ${JSON.stringify(t)} is not FIRST-LAST (e.g. 1-4) or a count`);
  return [Number(m[1]), Number(m[2] ?? m[1])];
}

function planBody() {
  const body = {
    workload: $("#plan-workload").value,
    workload_args: parsePairs($("#plan-args").value, "args"),
    hardware: $("#plan-hardware").value.split(/[\s,]+/).filter(Boolean),
    fix: parsePairs($("#plan-fix").value, "fix"),
  };
  const nodes = parseNodes($("#plan-nodes").value);
  if (nodes) body.nodes = nodes;
  const batch = $("#plan-batch").value.trim();
  if (batch) body.global_batch_size = Number(batch);
  return body;
}

async function submitPlan(event) {
  event.preventDefault();
  const seq = ++plan.seq; // a later submit wins over an earlier, slower answer
  const button = $("#plan-submit");
  try {
    const body = planBody();
    button.disabled = true;
    fill("#plan-status", "planning…");
    delete fill("#plan-result").dataset.fits;
    const result = await callJSON("plan", body);
    if (seq !== plan.seq) return;
    planError(null);
    renderPlan(result);
  } catch (err) {
    if (seq !== plan.seq) return;
    planError(err);
    delete fill("#plan-result").dataset.fits;
  } finally {
    if (seq === plan.seq) {
      button.disabled = false;
      fill("#plan-status");
    }
  }
}

// ---- the answer ------------------------------------------------------------------------------------

function renderPlan(r) {
  const result = $("#plan-result");
  const ranking = r.objective === "cost_per_million_tokens" ? "cost per million tokens" : "tokens/s per device";
  const priced = r.plans.some((p) => p.cost_per_million_tokens !== null && p.cost_per_million_tokens !== undefined);
  fill("#plan-result",
    h("p", { id: "plan-summary", class: "muted" }, `${r.workload} · global batch ${r.global_batch_size} `
      + `(${fmtNum(r.tokens_per_step)} tokens a step) · ranked by ${ranking} · ${r.considered} configurations `
      + `considered, ${r.timed} timed, in ${fmtSeconds(r.seconds)}`),
    r.notes.length ? h("ul", { class: "plan-notes" }, r.notes.map((n) => h("li", {}, n))) : null,
    r.fits ? null : h("div", { id: "plan-would-fit", class: "would-fit" },
      h("strong", {}, "Nothing fits. "), r.plans.length ? "The closest plans are below. " : null,
      r.what_would_fit.length ? h("span", {}, "What would fit:") : "Nothing the planner tried would fit.",
      h("ul", {}, r.what_would_fit.map((w) => h("li", {}, w)))),
    r.plans.length ? [planTable(r.plans, priced), planBars(r.plans)] : null);
  result.dataset.fits = String(r.fits); // set last: tests wait on it
}

const mesh = (c) => `${c.dp}/${c.tp}/${c.pp}/${c.cp}`;
function strategyText(c) {
  const parts = [c.strategy];
  if (c.dp_replicate > 1) parts.push(`hsdp ×${c.dp_replicate}`);
  if (c.pp > 1) parts.push(c.virtual_stages > 1 ? `${c.schedule} v${c.virtual_stages}` : c.schedule);
  if (c.sequence_parallel) parts.push("sp");
  if (c.offload !== "none") parts.push(`offload ${c.offload}`);
  return parts.join(" · ");
}
// Micro-batch size x micro-batches per step (the pipeline's, or the accumulation's without pp).
const batching = (c) => `${c.micro_batch_size} × ${c.microbatches * c.grad_accum}`;

function planTable(plans, priced) {
  const headers = ["#", "hardware", "dp/tp/pp/cp", "strategy", "micro-batch × accum", "checkpointing", "precision",
    "memory/device", "fits", "step", "tokens/s/device", "MFU", ...(priced ? ["$/M tokens"] : [])];
  return h("div", { id: "plan-table", class: "scroll" }, table(headers, plans.map((p, i) => {
    const c = p.config;
    return h("tr", { "data-plan-index": i, "data-fits": String(p.fits) },
      h("td", {}, i + 1), h("td", {}, p.hardware), h("td", { title: "dp/tp/pp/cp" }, mesh(c)),
      h("td", {}, strategyText(c)), h("td", { class: "num" }, batching(c)), h("td", {}, c.checkpointing),
      h("td", {}, c.precision), h("td", { class: "num", title: `usable ${fmtBytes(p.usable_bytes)}` },
        fmtBytes(p.memory_per_device_bytes)),
      h("td", {}, h("span", { class: `badge ${p.fits ? "st-ok" : "st-oom"}` }, p.fits ? "yes" : "no")), h("td", { class: "num" }, fmtSeconds(p.step_time_s)),
      h("td", { class: "num" }, fmtNum(p.tokens_per_s_per_device)),
      h("td", { class: "num" }, p.mfu === null || p.mfu === undefined ? "–" : `${(100 * p.mfu).toFixed(1)}%`),
      priced ? h("td", { class: "num" }, fmtNum(p.cost_per_million_tokens)) : null);
  })));
}

// Per plan: memory by part against the usable bytes (a mark where they end), and the step's seconds by part, on
// one time scale for every plan so that their lengths compare.
function planBars(plans) {
  const longest = Math.max(...plans.map((p) => p.step_time_s));
  return h("div", { id: "plan-bars", class: "plan-bars" },
    h("div", { class: "bar-legends" },
      barLegend("memory", MEMORY_PARTS.map(([k, color]) => [k.replace("_", " "), color])),
      barLegend("time", TIME_PARTS.map(([, label, color]) => [label, color]))),
    plans.map((p, i) => h("div", { class: "plan-bar-row", "data-plan-index": i },
      h("span", { class: "plan-bar-label" }, `#${i + 1} ${mesh(p.config)}`),
      memoryBar(p), timeBar(p, longest))));
}

function barLegend(title, entries) {
  return h("div", { class: "bar-legend" }, h("strong", {}, title),
    entries.map(([text, color]) => h("span", { class: "swatch-item" }, h("span", { class: "swatch", style: `background: ${color}` }), text)));
}

// Rects laid end to end from x = 0, `scale` px a unit; each carries its part and value for tests and tooltips.
function stack(cls, label, segments, scale, extra) {
  const svg = s("svg", { viewBox: `0 0 ${BAR_W} ${BAR_H}`, width: BAR_W, height: BAR_H, role: "img", "aria-label": label,
    class: `stackbar ${cls}` });
  let x = 0;
  for (const [part, value, color, text] of segments) {
    if (!(value > 0)) continue;
    const w = value * scale;
    svg.append(s("rect", { x, y: 0, width: Math.max(w, 0.5), height: BAR_H, fill: color, "data-part": part, "data-value": value },
      s("title", {}, text)));
    x += w;
  }
  for (const e of extra || []) svg.append(e);
  return svg;
}

function memoryBar(p) {
  const parts = p.memory || {};
  const span = Math.max(p.usable_bytes, p.memory_per_device_bytes) || 1;
  const scale = (BAR_W - 2) / span;
  const known = MEMORY_PARTS.map(([k]) => k);
  const segments = [...MEMORY_PARTS, ...Object.keys(parts).filter((k) => !known.includes(k)).map((k) => [k, "#c7cdd4"])]
    .map(([k, color]) => [k, parts[k] || 0, color, `${k.replace("_", " ")} ${fmtBytes(parts[k] || 0)}`]);
  const usable = p.usable_bytes * scale;
  const mark = s("line", { x1: usable, x2: usable, y1: 0, y2: BAR_H, class: "usable" },
    s("title", {}, `usable ${fmtBytes(p.usable_bytes)}`));
  return stack("bar-memory", `memory ${fmtBytes(p.memory_per_device_bytes)} of ${fmtBytes(p.usable_bytes)} usable`,
    segments, scale, [mark]);
}

function timeBar(p, longest) {
  const b = p.breakdown;
  const segments = TIME_PARTS.map(([k, label, color]) => [k, b[k], color, `${label} ${fmtSeconds(b[k])}`]);
  return stack("bar-time", `step ${fmtSeconds(p.step_time_s)}`, segments, (BAR_W - 2) / (longest || 1));
}

document.addEventListener("DOMContentLoaded", () => {
  $("#tab-tune").addEventListener("click", () => showView("tune"));
  $("#tab-plan").addEventListener("click", () => showView("plan"));
  $("#plan-form").addEventListener("submit", submitPlan);
  if (location.hash === "#plan") showView("plan");
});
