// The adaptive-spec ops page: three charts (uPlot, vendored), the champion, the drift alert, domains.
// Data: GET /api/stats/series, /api/stats/events and /api/stats/summary (service/routers/dashboard.py).
// window.dashboard holds what was drawn (points per version, markers per kind) for tests and debugging.
"use strict";

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"];
const FIXED_COLORS = { base: "#555b6e", target: "#a0a4b0" };
const MARKER_STYLE = { swap: ["#1f5fbf", [6, 4]], rollback: ["#b3261e", [2, 3]], promote: ["#2ca02c", [6, 4]] };
const REFRESH_MS = 10000;

const state = window.dashboard = {
  loaded: false, refreshes: 0, loadMs: null, versionsDrawn: {}, markersDrawn: {}, events: [], error: null,
};
const charts = {};
const colors = {};
let timer = null;

function colorFor(version) {
  if (FIXED_COLORS[version]) return FIXED_COLORS[version];
  if (!colors[version]) colors[version] = PALETTE[Object.keys(colors).length % PALETTE.length];
  return colors[version];
}

const fmt = (value, digits = 3) => value === null || value === undefined ? "–" : Number(value).toFixed(digits);
const versionName = v => (v === "base" || v === "target") ? v : "v" + v;
// What a marker moved to: "v5", or for a domain's adapter "sql: v5" ("sql: general adapter" once unloaded).
const markerTarget = e => e.domain ? `${e.domain}: ${e.version === "base" ? "general adapter" : versionName(e.version)}`
  : versionName(e.version);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  return body;
}

// Vertical lines at every swap and rollback, counted as they are drawn.
function markersPlugin() {
  return { hooks: { draw: [u => {
    const { ctx } = u;
    const { top, height } = u.bbox;
    const counts = { swap: 0, rollback: 0, promote: 0 };
    const dpr = window.devicePixelRatio || 1;
    for (const event of state.events) {
      if (event.t < u.scales.x.min || event.t > u.scales.x.max) continue;
      const [color, dash] = MARKER_STYLE[event.kind] || MARKER_STYLE.swap;
      const x = Math.round(u.valToPos(event.t, "x", true));
      ctx.save();
      ctx.strokeStyle = color; ctx.fillStyle = color; ctx.lineWidth = 2 * dpr;
      ctx.setLineDash(dash.map(d => d * dpr));
      ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
      ctx.font = `${11 * dpr}px system-ui, sans-serif`;
      const nearRightEdge = x > u.bbox.left + 0.8 * u.bbox.width;
      ctx.textAlign = nearRightEdge ? "right" : "left";
      const row = (counts.swap + counts.rollback + counts.promote) % 4;  // stagger labels of close markers
      ctx.fillText(`${event.kind} → ${markerTarget(event)}`, x + (nearRightEdge ? -4 : 4) * dpr, top + (12 + 12 * row) * dpr);
      ctx.restore();
      counts[event.kind] = (counts[event.kind] || 0) + 1;
    }
    if (u.root.parentElement && u.root.parentElement.id === "acceptance-chart") {
      state.markersDrawn = counts;
      u.root.parentElement.dataset.swapMarkers = counts.swap;
      u.root.parentElement.dataset.rollbackMarkers = counts.rollback;
    }
  }] } };
}

function drawChart(id, series, figure, range, { height = 220, withMarkers = false, skip = [], y = null } = {}) {
  const container = document.getElementById(id);
  const versions = Object.keys(series.by_version).filter(v => !skip.includes(v));
  const data = [series.t, ...versions.map(v => series.by_version[v][figure])];
  const opts = {
    width: Math.max(300, container.clientWidth), height,
    scales: { x: { time: true, range: () => range }, ...(y ? { y: { range: () => y } } : {}) },
    series: [{}, ...versions.map(v => ({ label: versionName(v), stroke: colorFor(v), width: 2, spanGaps: false,
                                         points: { show: true, size: 6, fill: colorFor(v) },
                                         value: (u, value) => fmt(value) }))],
    axes: [{}, { size: 50 }],
    plugins: withMarkers ? [markersPlugin()] : [],
  };
  if (charts[id]) charts[id].destroy();
  charts[id] = new uPlot(opts, data, container);
  const drawn = {};
  versions.forEach((v, i) => { drawn[v] = data[i + 1].filter(value => value !== null).length; });
  return drawn;
}

function renderChampion(summary) {
  const box = document.getElementById("champion");
  box.replaceChildren();
  const champion = summary.champion;
  document.getElementById("served").textContent = "served: " + (summary.served_version === null ? "base draft" : "v" + summary.served_version);
  const decoding = summary.decoding;
  if (decoding) {
    const exactness = decoding.exact === null ? "" : decoding.exact ? ", exact" : ", NOT exact";
    document.getElementById("decoding").textContent = `decoding: ${decoding.dtype} ${decoding.path}${exactness}`;
  }
  if (!champion) {
    box.append(el("p", { class: "muted" }, summary.served_version === null
      ? "The base draft is served: no adapter has been promoted yet."
      : "No gate figures were recorded for this version (loaded without its metadata)."));
    return;
  }
  const gate = champion.gate || {};
  const candidate = gate.candidate || {}, before = gate.champion || {};
  const rows = [
    ["version", versionName(champion.version)],
    ["gated greedy match", `${fmt(candidate.greedy_match)} (was ${fmt(before.greedy_match)})`],
    ["gated expected acceptance", `${fmt(candidate.expected_acceptance)} (was ${fmt(before.expected_acceptance)})`],
    ["held-out positions", candidate.positions ?? "–"],
    ["gate", gate.reason ?? "–"],
    ["training loss", fmt(champion.loss)],
    ["parent version", champion.parent_version ?? "base"],
    ["loaded", champion.loaded_at ? new Date(champion.loaded_at * 1000).toLocaleString() : "–"],
  ];
  const list = el("dl", { id: "champion-figures", "data-version": champion.version });
  for (const [name, value] of rows) list.append(el("dt", {}, name), el("dd", {}, String(value)));
  box.append(list);
}

// "0", or "6 (model 2, vocab 4)": records the trainer's screen dropped (trainer/screening.py), by reason.
function rejectedRecords(status) {
  const byReason = Object.entries(status.rejected_by_reason ?? {}).sort();
  const total = status.rejected_records ?? 0;
  return byReason.length ? `${total} (${byReason.map(([reason, n]) => `${reason} ${n}`).join(", ")})` : String(total);
}

function renderTrainer(summary) {
  const box = document.getElementById("trainer");
  box.replaceChildren();
  const status = summary.trainer;
  if (!status) {
    box.append(el("p", { class: "muted" }, "No trainer has reported in the last day (adaptive-spec up or train runs one)."));
    return;
  }
  const age = Math.max(0, Math.round(summary.now - status.at));
  const list = el("dl", { id: "trainer-status", "data-state": status.state });
  for (const [name, value] of [
    ["state", status.state], ["says", status.message], ["champion", status.champion ?? "–"],
    ["rounds", status.round], ["trainer", status.consumer], ["when", `${age} s ago`],
    ["records rejected", rejectedRecords(status)]]) {
    list.append(el("dt", {}, name), el("dd", {}, String(value)));
  }
  const failure = status.last_failure;  // a round that raised; the trainer went on (trainer/online.py)
  if (failure) {
    const ago = Math.max(0, Math.round(summary.now - failure.at));
    list.append(el("dt", {}, "last failed round"), el("dd", { id: "trainer-failure" }, `${ago} s ago: ${failure.message}`));
  }
  box.append(list);
}

function renderDrift(summary) {
  const drift = summary.drift;
  const banner = document.getElementById("drift-alert");
  banner.dataset.alert = String(Boolean(drift.alert));
  banner.hidden = !drift.alert;
  banner.textContent = drift.alert
    ? `Drift alert: ${versionName(drift.version)} accepts ${fmt(drift.first_token_acceptance)} of first draft tokens over the last ` +
      `${Math.round(drift.window_s / 60)} min, below ${drift.fraction} × its gated ${fmt(drift.expected)}. ` +
      "Traffic may have drifted from what the adapter was trained on; see ops/RUNBOOK.md."
    : "";
  const box = document.getElementById("drift");
  box.replaceChildren();
  const list = el("dl");
  for (const [name, value] of [
    ["state", drift.alert ? "ALERT" : "ok"], ["why", drift.reason],
    ["window", `${Math.round(drift.window_s / 60)} min, ${drift.drafts} drafting steps (needs ${drift.min_drafts})`],
    ["first-token acceptance", fmt(drift.first_token_acceptance)], ["acceptance rate", fmt(drift.acceptance_rate)],
    ["gated figure", fmt(drift.expected)], ["alert below", fmt(drift.threshold)]]) {
    list.append(el("dt", {}, name), el("dd", {}, String(value)));
  }
  const failure = status.last_failure;  // a round that raised; the trainer went on (trainer/online.py)
  if (failure) {
    const ago = Math.max(0, Math.round(summary.now - failure.at));
    list.append(el("dt", {}, "last failed round"), el("dd", { id: "trainer-failure" }, `${ago} s ago: ${failure.message}`));
  }
  box.append(list);
}

function renderDomains(summary) {
  const body = document.querySelector("#domains tbody");
  body.replaceChildren();
  for (const row of summary.domains) {
    body.append(el("tr", { "data-domain": row.domain }, el("td", {}, row.domain), el("td", {}, String(row.requests)),
      el("td", {}, fmt(row.acceptance_rate)), el("td", {}, fmt(row.first_token_acceptance)),
      el("td", {}, fmt(row.mean_acceptance_length, 2)), el("td", {}, fmt(row.draft_k, 2)),
      el("td", {}, row.adapter === null ? "base draft" : versionName(row.adapter)), el("td", {}, fmt(row.tokens_per_s, 1)),
      el("td", {}, row.speedup === null ? "not measured" : fmt(row.speedup, 2) + "×")));
  }
  if (!summary.domains.length) body.append(el("tr", {}, el("td", { colspan: "9", class: "muted" }, "no traffic in this range")));
}

function renderEvents(events) {
  const list = document.getElementById("events");
  list.replaceChildren();
  for (const event of events.slice().reverse()) {
    list.append(el("li", { "data-kind": event.kind, "data-version": event.version },
      new Date(event.t * 1000).toLocaleString() + " ", el("span", { class: "kind-" + event.kind }, event.kind),
      ` to ${markerTarget(event)} by ${event.by}` + (event.replicas > 1 ? ` (${event.replicas} replicas)` : "")));
  }
  if (!events.length) list.append(el("li", { class: "muted" }, "none in this range"));
}

async function refresh() {
  const started = performance.now();
  const seconds = Number(document.getElementById("range").value);
  const to = Date.now() / 1000, from = to - seconds;
  const query = `from=${from.toFixed(0)}&to=${to.toFixed(0)}`;
  try {
    const [series, events, summary] = await Promise.all([
      getJSON("/api/stats/series?" + query), getJSON("/api/stats/events?" + query), getJSON("/api/stats/summary?" + query)]);
    state.events = events.events;
    state.series = series;
    state.summary = summary;
    const range = [series.from, series.to];
    const drawn = drawChart("acceptance-chart", series, "acceptance_rate", range, { height: 280, withMarkers: true, skip: ["target"], y: [0, 1] });
    drawChart("length-chart", series, "mean_acceptance_length", range, { withMarkers: true, skip: ["target"] });
    drawChart("speed-chart", series, "tokens_per_s", range, { withMarkers: true });
    state.versionsDrawn = Object.fromEntries(Object.entries(drawn).filter(([, n]) => n > 0));
    document.getElementById("acceptance-chart").dataset.versions = Object.keys(state.versionsDrawn).join(",");
    renderChampion(summary);
    renderTrainer(summary);
    renderDrift(summary);
    renderDomains(summary);
    renderEvents(state.events);
    document.getElementById("error").hidden = true;
    state.error = null;
    document.getElementById("updated").textContent =
      `updated ${new Date().toLocaleTimeString()} · ${series.t.length} points of ${series.step} s`;
  } catch (error) {
    state.error = String(error.message || error);
    const box = document.getElementById("error");
    box.hidden = false;
    box.textContent = "Could not load the stats: " + state.error;
  }
  state.refreshes += 1;
  state.lastRefreshMs = performance.now() - started;
  if (!state.loaded) { state.loaded = true; state.loadMs = performance.now(); document.body.dataset.loaded = "true"; }
}

function schedule() {
  clearInterval(timer);
  if (document.getElementById("auto").checked) timer = setInterval(refresh, REFRESH_MS);
}

const wanted = new URLSearchParams(location.search).get("range");  // e.g. /dashboard?range=86400
if (wanted && [...document.getElementById("range").options].some(o => o.value === wanted)) {
  document.getElementById("range").value = wanted;
}
document.getElementById("range").addEventListener("change", refresh);
document.getElementById("auto").addEventListener("change", schedule);
window.addEventListener("resize", () => { if (state.series) refresh(); });
schedule();
refresh();
