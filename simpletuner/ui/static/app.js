// simpletuner web UI: the four pages' behaviour. Plain JS, no build step; charts with uPlot (static/vendor/uplot).
"use strict";

const CSRF = document.querySelector('meta[name="csrf-token"]').content;
const enc = encodeURIComponent;
// metrics.jsonl keys drawn first, in this order; every other numeric key follows, alphabetically
const PREFERRED = ["loss", "lr", "samples_per_s", "data_wait_share", "mfu", "tflops", "step_time_s"];
const NOT_CURVES = new Set(["step", "time", "to_first_step_s"]);
const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

// --- helpers -----------------------------------------------------------------------------------------
async function getJSON(url) {
  const response = await fetch(url, { credentials: "same-origin" });
  if (!response.ok) {
    const error = new Error(`${response.status} ${url}`);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

async function post(url, data) {
  const response = await fetch(url, {
    method: "POST",
    credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-CSRF-Token": CSRF },
    body: JSON.stringify(data || {}),
  });
  let body = null;
  try { body = await response.json(); } catch (e) { body = { error: `${response.status}` }; }
  return { ok: response.ok, status: response.status, body };
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmtNumber(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (Math.abs(value) >= 1000 || (value !== 0 && Math.abs(value) < 0.001)) return value.toExponential(2);
  return Number(value.toPrecision(digits)).toString();
}

function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

function fmtTime(epoch) {
  return epoch ? new Date(epoch * 1000).toLocaleString() : "–";
}

function fmtBytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

const fileURL = (runId, rel, download) => `/file?run=${enc(runId)}&path=${enc(rel)}${download ? "&download=1" : ""}`;
const runURL = (runId) => "/runs/" + runId.split("/").map(enc).join("/");

function stateBadge(state) {
  return el("span", { class: `state state-${state}`, text: state });
}

function curveKeys(records) {
  const keys = new Set();
  for (const record of records) {
    for (const [key, value] of Object.entries(record)) {
      if (!NOT_CURVES.has(key) && typeof value === "number") keys.add(key);
    }
  }
  const preferred = PREFERRED.filter((key) => keys.has(key));
  return preferred.concat([...keys].filter((key) => !PREFERRED.includes(key)).sort());
}

// --- charts ------------------------------------------------------------------------------------------
// One uPlot chart per metric; each series is a run (one on the run page, several on Compare).
class Charts {
  constructor(container, seriesNames) {
    this.container = container;
    this.names = seriesNames;
    this.data = new Map(); // key -> [ Map(step -> value) per series ]
    this.plots = new Map(); // key -> uPlot
    this.pending = false;
    this.width = () => Math.max(280, Math.min(560, this.container.clientWidth - 8));
    window.addEventListener("resize", () => { for (const plot of this.plots.values()) plot.setSize(this.size()); });
  }

  size() { return { width: this.width(), height: 200 }; }

  // Add one metrics record of series `index`; a step at or before the last drawn one (a run restarted or
  // resumed from an earlier checkpoint) replaces the points from there on.
  add(index, record) {
    if (typeof record.step !== "number") return;
    for (const [key, value] of Object.entries(record)) {
      if (NOT_CURVES.has(key) || typeof value !== "number") continue;
      if (!this.data.has(key)) this.data.set(key, this.names.map(() => new Map()));
      const points = this.data.get(key)[index];
      for (const step of [...points.keys()]) if (step >= record.step) points.delete(step);
      points.set(record.step, value);
    }
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.draw(); });
  }

  aligned(key) {
    const series = this.data.get(key);
    const steps = [...new Set(series.flatMap((points) => [...points.keys()]))].sort((a, b) => a - b);
    return [steps, ...series.map((points) => steps.map((step) => (points.has(step) ? points.get(step) : null)))];
  }

  draw() {
    const hint = this.container.querySelector(".hint");
    if (hint && this.data.size) hint.remove();
    const order = curveKeys([Object.fromEntries([...this.data.keys()].map((key) => [key, 0]))]);
    for (const key of order) {
      const data = this.aligned(key);
      if (this.plots.has(key)) {
        this.plots.get(key).setData(data);
        continue;
      }
      const box = el("div", { class: "chart", "data-metric": key, "data-points": data[0].length });
      this.container.append(box);
      const series = [{ label: "step" }].concat(this.names.map((name, i) => ({
        label: name, stroke: COLOURS[i % COLOURS.length], width: 1.5, spanGaps: true,
        points: { show: data[0].length < 40 },
      })));
      const options = {
        title: key, ...this.size(), series,
        scales: { x: { time: false } },
        axes: [{ label: "step" }, { size: 60, values: (u, ticks) => ticks.map((t) => fmtNumber(t)) }],
        legend: { show: this.names.length > 1 },
      };
      this.plots.set(key, new uPlot(options, data, box));
    }
    for (const [key, plot] of this.plots) plot.root.parentElement.dataset.points = this.aligned(key)[0].length;
  }
}

// --- jobs table (Runs and New run) ---------------------------------------------------------------------
async function refreshJobs(table) {
  let jobs;
  try { jobs = (await getJSON("/api/jobs")).jobs; } catch (e) { return; }
  const body = table.tBodies[0];
  body.replaceChildren();
  if (!jobs.length) {
    body.append(el("tr", {}, el("td", { class: "hint", text: "no jobs launched from this page yet" })));
    return;
  }
  body.append(el("tr", {}, ["Job", "State", "Config", "Output", "Exit", "Note"].map((h) => el("th", { text: h }))));
  for (const job of jobs.slice().reverse()) {
    body.append(el("tr", { "data-job": job.id },
      el("td", { text: job.id + (job.resume ? " (resume)" : "") }),
      el("td", {}, stateBadge(job.state)),
      el("td", { class: "path", text: job.config_path }),
      el("td", { class: "path", text: job.output_dir || "–" }),
      el("td", { text: job.returncode ?? "" }),
      el("td", { text: job.waiting_for || "" }),
    ));
  }
}

// --- page: runs ----------------------------------------------------------------------------------------
function runsPage() {
  const table = document.getElementById("runs");
  const compare = document.getElementById("compare");
  const selected = new Set();
  compare.addEventListener("click", () => {
    location.href = "/compare?runs=" + [...selected].map(enc).join(",");
  });
  const update = () => { compare.disabled = selected.size < 2; };
  async function refresh() {
    let runs;
    try { runs = (await getJSON("/api/runs")).runs; } catch (e) { return; }
    const body = table.tBodies[0];
    body.replaceChildren();
    if (!runs.length) {
      body.append(el("tr", {}, el("td", { colspan: 11, class: "hint" },
        "No run folders here yet. ", el("a", { href: "/new", text: "Start one" }), " (Demo trains a tiny model on a CPU).")));
    }
    for (const run of runs) {
      const box = el("input", { type: "checkbox", checked: selected.has(run.id), "aria-label": `select ${run.id}` });
      box.addEventListener("change", () => { box.checked ? selected.add(run.id) : selected.delete(run.id); update(); });
      body.append(el("tr", { "data-run": run.id },
        el("td", {}, box),
        el("td", {}, el("a", { href: runURL(run.id), text: run.id })),
        el("td", {}, stateBadge(run.state)),
        el("td", { text: `${run.step ?? "–"} / ${run.total ?? "–"}` }),
        el("td", { text: fmtDuration(run.eta_s) }),
        el("td", { text: fmtNumber(run.last_loss, 4) }),
        el("td", { text: fmtNumber(run.samples_per_s) }),
        el("td", { text: run.mfu === null ? "–" : `${(100 * run.mfu).toFixed(1)}%` }),
        el("td", { text: fmtTime(run.started) }),
        el("td", { text: run.model_family || "–" }),
        el("td", { text: run.config_name || "–" }),
      ));
    }
    update();
  }
  refresh();
  refreshJobs(document.getElementById("jobs"));
  setInterval(() => { refresh(); refreshJobs(document.getElementById("jobs")); }, 2000);
}

// --- validation slider (run page and compare) ----------------------------------------------------------
// `state` keeps the picked index across calls: it follows the newest step until the user picks another.
function setupSlider(steps, onChange, state, initial) {
  const slider = document.getElementById("val-slider");
  const label = document.getElementById("val-step");
  if (state.index === undefined) state.index = initial ?? steps.length - 1;
  else if (state.index >= state.count - 1) state.index = steps.length - 1;
  state.count = steps.length;
  slider.max = Math.max(0, steps.length - 1);
  slider.disabled = steps.length < 2;
  slider.value = state.index;
  const show = () => {
    state.index = Number(slider.value);
    label.textContent = steps.length ? `step ${steps[state.index]} (${state.index + 1} of ${steps.length})` : "";
    onChange(steps[state.index]);
  };
  slider.oninput = show;
  show();
}

// --- page: one run -------------------------------------------------------------------------------------
function runPage() {
  const runId = document.body.dataset.runId;
  const $ = (id) => document.getElementById(id);
  const charts = new Charts($("charts"), [runId]);
  const slider = {};
  let state = null;
  let detailTimer = null;
  let source = null;

  function showSummary(summary) {
    state = summary.state;
    $("state").replaceWith(Object.assign(stateBadge(summary.state), { id: "state" }));
    if (summary.step !== null) $("step").textContent = summary.step;
    $("total").textContent = summary.total ?? "–";
    if (summary.total) {
      $("progress").max = summary.total;
      $("progress").value = Math.min(summary.step || 0, summary.total);
    }
    $("eta").textContent = summary.eta_s ? `ETA ${fmtDuration(summary.eta_s)}` : "";
    $("stop").disabled = summary.state !== "running";
    $("resume").disabled = !["stopped", "failed"].includes(summary.state);
  }

  function showDetail(detail) {
    showSummary(detail.summary);
    const validation = detail.validation;
    setupSlider(validation.map((v) => v.step), (step) => {
      const entry = validation.find((v) => v.step === step);
      const box = $("validation");
      box.replaceChildren();
      if (!entry) { box.append(el("p", { class: "hint", text: "no validation images yet" })); return; }
      const pictures = entry.grid ? [entry.grid] : entry.images;
      for (const rel of pictures) {
        box.append(el("a", { href: fileURL(runId, rel), target: "_blank" },
          el("img", { src: fileURL(runId, rel), alt: rel, class: "validation-image", "data-step": step })));
      }
    }, slider);
    $("before-after").replaceChildren(...(detail.before_after ? [
      el("h3", { text: "Before | after" }),
      el("img", { src: fileURL(runId, detail.before_after), alt: "before and after training", class: "before-after" }),
    ] : []));
    const files = (entries) => el("ul", {}, entries.map((f) => el("li", {},
      el("a", { href: fileURL(runId, f.path, true), text: f.path }), ` ${fmtBytes(f.bytes)}`)));
    const parts = [];
    for (const checkpoint of detail.checkpoints) {
      parts.push(el("details", { class: "checkpoint", "data-step": checkpoint.step },
        el("summary", { text: `${checkpoint.name} (step ${checkpoint.step})` }), files(checkpoint.files)));
    }
    if (detail.weights.length) parts.push(el("h3", { text: "Final weights" }), files(detail.weights));
    $("checkpoints").replaceChildren(...(parts.length ? parts : [el("p", { class: "hint", text: "none yet" })]));
    $("config").textContent = JSON.stringify(detail.config, null, 2);
    $("sources").replaceChildren(...detail.sources.map((line) => el("li", { text: line })));
  }

  async function loadDetail() {
    try {
      showDetail(await getJSON(`/api/run?id=${enc(runId)}`));
      return true;
    } catch (error) {
      if (error.status !== 404) throw error;
      return false;
    }
  }

  function scheduleDetail() {
    if (detailTimer) return;
    detailTimer = setTimeout(() => { detailTimer = null; loadDetail(); }, 300);
  }

  function appendLog(line) {
    const log = $("log");
    log.append(line + "\n");
    while (log.childNodes.length > 400) log.firstChild.remove();
    log.scrollTop = log.scrollHeight;
    if (/saved checkpoint|validation images|saved .*\.safetensors|run stopped/.test(line)) scheduleDetail();
  }

  function connect() {
    source = new EventSource(`/api/events?id=${enc(runId)}`);
    source.addEventListener("metric", (event) => {
      const record = JSON.parse(event.data);
      charts.add(0, record);
      if (typeof record.step === "number") {
        const shown = Number($("step").textContent);
        if (!(record.step < shown)) $("step").textContent = record.step;
        if ($("progress").max > 1) $("progress").value = record.step;
      }
    });
    source.addEventListener("log", (event) => appendLog(JSON.parse(event.data)));
    source.addEventListener("state", (event) => {
      const summary = JSON.parse(event.data);
      const changed = summary.state !== state;
      showSummary(summary);
      if (changed) scheduleDetail();
    });
  }

  // Before its folder exists (a job just queued) the run page waits, showing the job and its launcher log.
  async function waitForRun() {
    if (await loadDetail()) { connect(); return; }
    $("state").textContent = "waiting";
    let message = "waiting for the run to start…";
    try {
      const jobs = (await getJSON("/api/jobs")).jobs.filter((job) => job.output_dir && job.output_dir.endsWith("/" + runId));
      const job = jobs[jobs.length - 1];
      if (job) {
        message = `job ${job.id}: ${job.state}${job.waiting_for ? ", waiting for " + job.waiting_for : ""}`;
        if (["failed", "stopped"].includes(job.state)) {
          const response = await fetch(`/api/job_log?id=${enc(job.id)}`, { credentials: "same-origin" });
          $("log").textContent = await response.text();
        }
      }
    } catch (e) { /* the next try tells */ }
    $("message").textContent = message;
    setTimeout(waitForRun, 1000);
  }

  $("stop").addEventListener("click", async () => {
    $("stop").disabled = true;
    const answer = await post("/api/stop", { id: runId });
    $("message").textContent = answer.ok && answer.body.stopped
      ? "stop sent (SIGTERM): the run saves a checkpoint and exits"
      : `could not stop it: ${answer.body.error || "no process found"}`;
  });
  $("resume").addEventListener("click", async () => {
    $("resume").disabled = true;
    const answer = await post("/api/resume", { id: runId });
    $("message").textContent = answer.ok
      ? `resume queued as job ${answer.body.job.id}: it continues from the latest checkpoint`
      : `could not resume: ${answer.body.error}`;
  });
  waitForRun();
}

// --- page: new run -------------------------------------------------------------------------------------
function newPage() {
  const $ = (id) => document.getElementById(id);
  const jobs = $("jobs");

  function showResult(result) {
    const box = $("result");
    box.replaceChildren();
    box.append(el("p", { class: result.ok ? "ok" : "bad" },
      result.ok ? `No problems (${result.dialect} config).` :
        `${result.problems.length} problem${result.problems.length === 1 ? "" : "s"} (${result.dialect} config):`));
    if (result.problems.length) box.append(el("ul", { class: "problems" }, result.problems.map((p) => el("li", { text: p }))));
    if (result.notes && result.notes.length) {
      box.append(el("details", { open: true }, el("summary", { text: "Notes from the loader" }),
        el("ul", { class: "notes" }, result.notes.map((n) => el("li", { text: n })))));
    }
    if (result.estimate_text && result.estimate_text.length) {
      box.append(el("h3", { text: "Memory estimate" }), el("pre", { class: "estimate", text: result.estimate_text.join("\n") }));
    }
  }

  const payload = (extra) => ({ text: $("config").value, filename: $("filename").value || "config.json", ...extra });

  $("demo").addEventListener("click", async () => {
    $("demo").disabled = true;
    $("result").replaceChildren(el("p", { class: "hint", text: "writing the demo's tiny model and dataset…" }));
    const answer = await post("/api/demo");
    $("demo").disabled = false;
    if (!answer.ok) { $("result").replaceChildren(el("p", { class: "bad", text: answer.body.error })); return; }
    $("config").value = answer.body.text;
    $("filename").value = answer.body.filename;
    $("result").replaceChildren(el("p", { class: "ok", text: `Demo written: ${answer.body.config_path}. Launch it.` }));
  });
  getJSON("/api/presets").then((offer) => {
    for (const p of offer.presets) {
      $("preset").append(el("option", { value: p.name, text: `${p.name}: ${p.workload}` }));
    }
    for (const name of offer.examples) $("example").append(el("option", { value: name, text: name }));
  });
  $("example").addEventListener("change", async () => {
    const name = $("example").value;
    if (!name) return;
    const example = await getJSON(`/api/example?name=${enc(name)}`);
    $("config").value = example.text;
    $("filename").value = example.filename;
    $("example").value = "";
  });
  $("preset").addEventListener("change", async () => {
    const preset = $("preset").value;
    if (!preset) return;
    $("preset").value = "";
    const answer = await post("/api/preset", payload({ preset }));
    if (!answer.ok) { $("result").replaceChildren(el("p", { class: "bad", text: answer.body.error })); return; }
    $("config").value = answer.body.text;
    $("filename").value = answer.body.filename;
    $("result").replaceChildren(el("p", { class: "ok", text: `Preset ${preset} merged: Check the config, then Launch.` }),
      el("pre", { class: "estimate", text: answer.body.lines.join("\n") }));
  });
  $("file").addEventListener("change", async () => {
    const file = $("file").files[0];
    if (!file) return;
    $("config").value = await file.text();
    $("filename").value = file.name;
  });
  $("check").addEventListener("click", async () => {
    $("result").replaceChildren(el("p", { class: "hint", text: "checking (and estimating memory)…" }));
    const answer = await post("/api/check", payload());
    if (answer.body.problems === undefined) { $("result").replaceChildren(el("p", { class: "bad", text: answer.body.error })); return; }
    showResult(answer.body);
  });
  $("launch").addEventListener("click", async () => {
    $("launch").disabled = true;
    const answer = await post("/api/launch", payload());
    $("launch").disabled = false;
    if (answer.body.problems === undefined) { $("result").replaceChildren(el("p", { class: "bad", text: answer.body.error })); return; }
    if (!answer.ok) { showResult(answer.body); return; }
    location.href = runURL(answer.body.run_id);
  });
  refreshJobs(jobs);
  setInterval(() => refreshJobs(jobs), 2000);
}

// --- page: compare -------------------------------------------------------------------------------------
async function comparePage() {
  const ids = (new URLSearchParams(location.search).get("runs") || "").split(",").filter(Boolean);
  const charts = new Charts(document.getElementById("charts"), ids);
  document.getElementById("legend").replaceChildren(...ids.map((id, i) => el("li", {},
    el("span", { class: "swatch", style: `background:${COLOURS[i % COLOURS.length]}` }),
    el("a", { href: runURL(id), text: id }))));
  const details = await Promise.all(ids.map((id) => getJSON(`/api/run?id=${enc(id)}`).catch(() => null)));
  await Promise.all(ids.map(async (id, i) => {
    const records = details[i] ? (await getJSON(`/api/metrics?id=${enc(id)}`)).metrics : [];
    for (const record of records) charts.add(i, record);
  }));
  const steps = [...new Set(details.flatMap((d) => (d ? d.validation.map((v) => v.step) : [])))].sort((a, b) => a - b);
  // the last step every run has pictures of, else the newest
  const common = steps.filter((step) => details.every((d) => d && d.validation.some((v) => v.step === step)));
  const initial = common.length ? steps.indexOf(common[common.length - 1]) : undefined;
  setupSlider(steps, (step) => {
    const box = document.getElementById("side-by-side");
    box.replaceChildren(...ids.map((id, i) => {
      const entry = details[i] && details[i].validation.find((v) => v.step === step);
      const pictures = entry ? (entry.grid ? [entry.grid] : entry.images) : [];
      return el("figure", { class: "compare-cell" },
        ...pictures.map((rel) => el("img", { src: fileURL(id, rel), alt: `${id} step ${step}`, class: "validation-image" })),
        pictures.length ? null : el("p", { class: "hint", text: details[i] ? `no images at step ${step}` : "no such run" }),
        el("figcaption", { text: id }));
    }));
  }, {}, initial);
}

const PAGES = { runs: runsPage, run: runPage, new: newPage, compare: comparePage };
PAGES[document.body.dataset.page]();
