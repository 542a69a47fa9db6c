// advisor's Estimate view: a form that POSTs /v1/estimate/curve, and its answer drawn: the per-device memory as a
// stacked bar by part against the usable memory, the fit, the largest batch, and memory against batch size. The
// form lives in the address (#estimate?workload=...&hardware=...), so a link reopens the form and runs it.
// Uses app.js's helpers (h, s, fill, table, callJSON, the plot frame) and plan.js's (showView, parsePairs,
// MEMORY_PARTS, stack, barLegend); text from the API enters the page only as text nodes or attribute values.
"use strict";

// The form's fields, by the name each has in the address; the element of `f` is #est-<f>.
const EST_FIELDS = ["workload", "args", "hardware", "batch", "precision", "optimizer", "strategy", "checkpointing",
  "freeze", "lora_r", "lora_alpha", "lora_targets"];
const EST_SELECTS = ["precision", "optimizer", "strategy", "checkpointing"]; // filled from the API's schema
const CURVE_W = 760, CURVE_H = 340; // px of the plot's viewBox
const FITS_COLOR = "#2ca02c", NOFIT_COLOR = "#d62728";
const est = { choices: null, seq: 0, hash: null, fineTune: new Set() };

// ---- the view --------------------------------------------------------------------------------------

// The form as the address holds it: {field: value} from "#estimate?k=v&...", or null for another hash.
function hashState(hash) {
  const m = /^#estimate(?:\?(.*))?$/.exec(hash);
  return m ? Object.fromEntries(new URLSearchParams(m[1] || "")) : null;
}

function formState() {
  const st = {};
  for (const f of EST_FIELDS) {
    const el = $(`#est-${f}`);
    const value = el.value.trim();
    if (value && !el.closest("[hidden]")) st[f] = value;
  }
  return st;
}

const stateHash = (st) => "#estimate" + (Object.keys(st).length ? `?${new URLSearchParams(st)}` : "");

async function openEstimate(st) {
  showView("estimate");
  if (!st) history.replaceState(null, "", est.hash || "#estimate");
  try {
    await loadEstimateChoices();
  } catch {
    return; // the error box says why; the form stays as it is
  }
  if (!st || !Object.keys(st).length) return;
  for (const f of EST_FIELDS) $(`#est-${f}`).value = st[f] ?? (EST_SELECTS.includes(f) ? $(`#est-${f}`).dataset.default : "");
  await submitEstimate();
}

// Presets and catalog names for the free-text fields, the knobs' choices and defaults from the API's schema
// (GET /openapi.json), and the fine-tuning fields the estimate request takes: once.
function loadEstimateChoices() {
  est.choices ??= (async () => {
    const [workloads, hardware, schema] = await Promise.all([getJSON("workloads"), getJSON("hardware"), openapi()]);
    fill("#est-workload-names", workloads.map((w) => h("option", { value: w.name }, w.description || w.name)));
    fill("#est-hardware-names", hardware.map((hw) => h("option", { value: hw.name })));
    const schemas = schema.components.schemas;
    const props = (schemas.EstimateCurveRequest || schemas.EstimateRequest).properties;
    for (const f of EST_SELECTS) {
      const prop = props[f], choices = enumOf(schemas, prop);
      const select = $(`#est-${f}`), keep = select.value;
      fill(`#est-${f}`, choices.map((v) => h("option", { value: v }, v)));
      select.dataset.default = prop.default ?? choices[0];
      select.value = choices.includes(keep) ? keep : select.dataset.default;
    }
    const fineTune = props.finetune ? refOf(schemas, props.finetune) : null; // {freeze, lora} where served
    est.fineTune = new Set(["freeze", "lora"].filter((k) => k in (fineTune?.properties || {})));
    document.querySelectorAll("#est-finetune [data-needs]").forEach((el) => { el.hidden = !est.fineTune.has(el.dataset.needs); });
    $("#est-finetune").hidden = est.fineTune.size === 0;
    estError(null);
  })().catch((err) => {
    est.choices = null;
    estError(err);
    throw err;
  });
  return est.choices;
}

async function openapi() {
  const res = await fetch("openapi.json", { headers: { Accept: "application/json" } }); // beside the page, as v1/
  if (!res.ok) throw new Error(`GET /openapi.json: ${res.status} ${res.statusText}`);
  return res.json();
}

// The schema a field refers to (directly, or in allOf/anyOf, as an optional field does), or the field's own.
function refOf(schemas, prop) {
  const ref = prop.$ref || [...(prop.allOf || []), ...(prop.anyOf || [])].find((p) => p.$ref)?.$ref;
  return ref ? schemas[ref.split("/").at(-1)] : prop;
}
const enumOf = (schemas, prop) => refOf(schemas, prop).enum || [];

function estError(err) {
  const box = fill("#est-error", err ? (err.message || String(err)) : null);
  box.hidden = !err;
}

// ---- the form --------------------------------------------------------------------------------------

const words = (text) => text.split(/[\s,]+/).filter(Boolean);

function estimateBody() {
  const v = (f) => $(`#est-${f}`).value.trim();
  const body = { workload: v("workload"), workload_args: parsePairs(v("args"), "args"), hardware: v("hardware") };
  for (const f of EST_SELECTS) body[f] = v(f);
  if (v("batch")) body.batch_size = Number(v("batch"));
  const finetune = {};
  if (est.fineTune.has("freeze") && v("freeze")) finetune.freeze = words(v("freeze"));
  if (est.fineTune.has("lora") && v("lora_r")) {
    finetune.lora = { r: Number(v("lora_r")), targets: words(v("lora_targets")) }; // no targets: the API says so
    if (v("lora_alpha")) finetune.lora.alpha = Number(v("lora_alpha"));
  }
  if (Object.keys(finetune).length) body.finetune = finetune;
  return body;
}

async function submitEstimate(event) {
  event?.preventDefault();
  const seq = ++est.seq; // a later submit wins over an earlier, slower answer
  const button = $("#est-submit");
  try {
    const body = estimateBody();
    est.hash = stateHash(formState());
    history.replaceState(null, "", est.hash);
    button.disabled = true;
    fill("#est-status", "estimating…");
    delete fill("#est-result").dataset.fits;
    const curve = await callJSON("estimate/curve", body);
    if (seq !== est.seq) return;
    estError(null);
    renderEstimate(curve);
  } catch (err) {
    if (seq !== est.seq) return;
    estError(err);
    delete fill("#est-result").dataset.fits;
  } finally {
    if (seq === est.seq) {
      button.disabled = false;
      fill("#est-status");
    }
  }
}

// ---- the answer ------------------------------------------------------------------------------------

const deviceBytes = (x) => x.total_bytes + x.runtime_bytes; // what the usable memory must hold

function renderEstimate(c) {
  const e = c.estimate, r = e.request;
  const devices = e.world_size > 1 ? ` ×${e.world_size}` : "";
  fill("#est-result",
    h("p", { id: "est-summary", class: "muted" }, `${e.workload} on ${e.hardware}${devices} · batch ${r.batch_size} `
      + `per device · ${r.precision} · ${r.optimizer} · ${r.strategy} · checkpointing ${r.checkpointing} · `
      + `${fmtNum(e.num_params)} parameters · ${e.method}`
      + (e.predicted_step_s ? ` · step ${fmtSeconds(e.predicted_step_s)} by the roofline` : "")),
    h("div", { class: "est-verdict" },
      h("span", { id: "est-fits", class: `badge ${e.fits ? "st-ok" : "st-oom"}` }, e.fits ? "fits" : "does not fit"),
      h("span", {}, `${fmtBytes(deviceBytes(e))} of ${fmtBytes(e.usable_bytes)} usable per device `
        + `(${fmtBytes(e.device_memory_bytes)} on it)`),
      h("span", { id: "est-largest", "data-largest": e.max_batch_size }, e.max_batch_size
        ? `largest batch that fits: ${e.max_batch_size}` : "no batch fits, not even 1")),
    h("div", { id: "est-bar", class: "est-bar" }, barLegend("memory", presentParts(e).map(([k, , color]) =>
      [k.replace("_", " "), color])), memoryStack(e)),
    partsTable(e),
    h("figure", { class: "est-curve" }, h("figcaption", {}, "Memory per device against batch size"),
      h("div", { id: "est-plot", class: "plot" }, curvePlot(c))),
    e.notes.length ? h("ul", { class: "plan-notes muted" }, e.notes.map((n) => h("li", {}, n))) : null);
  $("#est-result").dataset.fits = String(e.fits); // set last: tests wait on it
}

// [part, bytes, colour] of the breakdown, then the runtime outside the allocator, those above 0.
function presentParts(e) {
  const colors = Object.fromEntries(MEMORY_PARTS);
  return [...Object.entries(e.breakdown), ["runtime", e.runtime_bytes]]
    .filter(([, bytes]) => bytes > 0).map(([k, bytes]) => [k, bytes, colors[k] || "#c7cdd4"]);
}

function memoryStack(e) {
  const span = Math.max(e.usable_bytes, deviceBytes(e)) || 1;
  const scale = (BAR_W - 2) / span, usable = e.usable_bytes * scale;
  const mark = s("line", { x1: usable, x2: usable, y1: 0, y2: BAR_H, class: "usable" },
    s("title", {}, `usable ${fmtBytes(e.usable_bytes)}`));
  return stack("bar-memory", `memory ${fmtBytes(deviceBytes(e))} of ${fmtBytes(e.usable_bytes)} usable`,
    presentParts(e).map(([k, bytes, color]) => [k, bytes, color, `${k.replace("_", " ")} ${fmtBytes(bytes)}`]),
    scale, [mark]);
}

function partsTable(e) {
  const whole = deviceBytes(e) || 1;
  return h("div", { id: "est-parts", class: "scroll" }, table(["part", "per device", "share"], presentParts(e).map(
    ([k, bytes]) => h("tr", { "data-part": k }, h("td", {}, k.replace("_", " ")),
      h("td", { class: "num" }, fmtBytes(bytes)), h("td", { class: "num" }, `${(100 * bytes / whole).toFixed(1)}%`)))));
}

// Memory against batch size on a log2 axis: the points (coloured by fit) and their line, the usable memory as a
// dashed line, the largest batch that fits as a dotted one.
function curvePlot(c) {
  const e = c.estimate, pts = c.points;
  if (!pts.length) return empty("no batch sizes to plot");
  const top = Math.max(e.usable_bytes, ...pts.map(deviceBytes));
  const unit = top >= GIB ? GIB : MIB, unitName = unit === GIB ? "GiB" : "MiB";
  const yTicks = niceTicks(0, top / unit), y = scale(0, yTicks.at(-1) * unit, CURVE_H - M.b, M.t);
  const lo = pts[0].batch_size, hi = pts.at(-1).batch_size, pad = lo === hi ? 1 : 0.25; // log2 units
  const x = scale(lo / 2 ** pad, hi * 2 ** pad, M.l, CURVE_W - M.r, true);
  const batches = pts.map((p) => p.batch_size);
  const xTicks = batches.length <= 10 ? batches
    : niceTicks(Math.log2(lo), Math.log2(hi)).filter(Number.isInteger).map((k) => 2 ** k).filter((v) => v >= lo && v <= hi);
  const svg = frame(CURVE_W, CURVE_H, `memory per device against batch size; usable ${fmtBytes(e.usable_bytes)}`);
  axes(svg, { width: CURVE_W, height: CURVE_H, x, y: (v) => y(v * unit), xTicks, yTicks, xFmt: String, yFmt: fmtTick,
    xLabel: "batch size per device (log scale)", yLabel: `memory per device (${unitName})` });
  const yu = y(e.usable_bytes);
  svg.append(s("line", { x1: M.l, x2: CURVE_W - M.r, y1: yu, y2: yu, class: "usable-line" },
    s("title", {}, `usable ${fmtBytes(e.usable_bytes)}`)));
  if (e.max_batch_size >= lo && e.max_batch_size <= hi) {
    const xl = x(e.max_batch_size);
    svg.append(s("line", { x1: xl, x2: xl, y1: M.t, y2: CURVE_H - M.b, class: "largest-line" }),
      // its label on the side with room: left of the line in the plot's right half
      s("text", { x: xl > CURVE_W / 2 ? xl - 4 : xl + 4, y: M.t + 12, class: "label",
        "text-anchor": xl > CURVE_W / 2 ? "end" : "start" }, `largest ${e.max_batch_size}`));
  }
  svg.append(s("polyline", { points: pts.map((p) => `${x(p.batch_size)},${y(deviceBytes(p))}`).join(" "),
    class: "trend", stroke: "#2563eb" }));
  for (const p of pts) {
    svg.append(s("circle", { cx: x(p.batch_size), cy: y(deviceBytes(p)), r: 4.5, class: "pt",
      fill: p.fits ? FITS_COLOR : NOFIT_COLOR, "data-batch": p.batch_size, "data-bytes": deviceBytes(p),
      "data-fits": String(p.fits) }, s("title", {}, `batch ${p.batch_size}: ${fmtBytes(deviceBytes(p))}`
      + (p.fits ? "" : " — does not fit"))));
  }
  legend(svg, [["fits", FITS_COLOR], ["does not fit", NOFIT_COLOR], ["usable", "#1d232b", "line"]]);
  return svg;
}

document.addEventListener("DOMContentLoaded", () => {
  $("#tab-estimate").addEventListener("click", () => openEstimate(null));
  $("#est-form").addEventListener("submit", submitEstimate);
  const opened = () => {
    const st = hashState(location.hash);
    if (st && location.hash !== est.hash) openEstimate(st);
  };
  window.addEventListener("hashchange", opened); // a pasted address with another form runs it
  opened();
});
