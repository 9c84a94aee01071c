// Bench: a saved `tokenmill bench serve` result (JSON) opened from disk and shown as its HTML report shows it —
// the summary table (the report's own rows, /ui/bench-rows.json), errors, the five plots, the configuration —
// drawn here: the file never leaves the browser.
import {getJSON} from "/ui/api.js";
import {escapeHtml} from "/ui/markdown.js";
import {COLORS, histogram, lineChart, noData, scatterChart} from "/ui/plot.js";

const $ = (id) => document.getElementById(id);

function getPath(obj, path) {
  let node = obj;
  for (const key of path.split(".")) {
    if (node == null || typeof node !== "object") return null;
    node = node[key];
  }
  return node ?? null;
}

function fmtValue(v, digits) {
  if (v == null) return "-";
  if (typeof v === "number") {
    if (!isFinite(v)) return "inf";
    return Number.isInteger(v) && digits === 0 ? String(v)
      : v.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
  }
  return String(v);
}

// Output tokens per bin, spread over each request's chunks, and requests in flight: as bench/metrics.py does.
function throughput(records) {
  const ok = records.filter((r) => r.success);
  const t0 = Math.min(...records.map((r) => r.start_s)), t1 = Math.max(...records.map((r) => r.end_s));
  const span = t1 - t0;
  if (!(span > 0)) return null;
  const bin = Math.max(span / 40, Math.min(1, span / 5));
  const n = Math.max(1, Math.ceil(span / bin));
  const tokens = new Array(n).fill(0);
  for (const r of ok) {
    if (r.ttft_s == null) continue;
    const times = [r.start_s + r.ttft_s];
    for (const g of r.itl_s) times.push(times[times.length - 1] + g);
    for (const t of times) tokens[Math.min(n - 1, Math.floor((t - t0) / bin))] += r.output_tokens / times.length;
  }
  const events = records.flatMap((r) => [[r.start_s, 1], [r.end_s, -1]]).sort((a, b) => a[0] - b[0] || a[1] - b[1]);
  let k = 0;
  return {tokens: tokens.map((v, i) => [t0 + i * bin, v / bin]), flight: events.map(([t, d]) => [t, (k += d)])};
}

function figure(title) {
  const fig = document.createElement("figure");
  fig.innerHTML = `<figcaption>${escapeHtml(title)}</figcaption><canvas width="760" height="260"></canvas>`;
  $("bench-plots").appendChild(fig);
  return fig.querySelector("canvas");
}

async function render(result) {
  const rows = await getJSON("/ui/bench-rows.json");
  const cfg = result.config || {};
  const report = $("bench-report");
  const summary = rows.map((r) => r.path == null
    ? `<tr><th class="section" colspan="2">${escapeHtml(r.label)}</th></tr>`
    : `<tr><td>${escapeHtml(r.label)}</td><td class="num">${escapeHtml(fmtValue(getPath(result, r.path), r.digits))}</td></tr>`)
    .join("");
  const errors = getPath(result, "summary.errors") || {};
  const errorRows = Object.entries(errors.by_type || {})
    .map(([k, v]) => `<tr><td>${escapeHtml(k)}</td><td class="num">${escapeHtml(String(v))}</td></tr>`).join("");
  const examples = (errors.examples || []).map((e) => `<li>${escapeHtml(`request ${e.index}: ${e.type}` +
    (e.status == null ? "" : ` (HTTP ${e.status})`) + `: ${String(e.message).slice(0, 300)}`)}</li>`).join("");
  const config = Object.entries(cfg)
    .map(([k, v]) => `<tr><td>${escapeHtml(k)}</td><td>${escapeHtml(typeof v === "object" ? JSON.stringify(v) : String(v))}</td></tr>`).join("");
  report.innerHTML = `<h2>${escapeHtml(`tokenmill bench: ${cfg.model} / ${cfg.dataset} / ${result.started_at}`)}</h2>` +
    `<div class="bench-grid"><div><h3>Summary</h3><table id="bench-summary">${summary}</table>` +
    `<h3>Errors</h3>${errors.total ? `<table>${errorRows}</table><ul>${examples}</ul>` : "<p>No errors.</p>"}</div>` +
    `<div><h3>Plots</h3><div id="bench-plots"></div></div></div>`;
  const records = result.requests || [];
  const ok = records.filter((r) => r.success);
  histogram(figure("TTFT distribution"), ok.filter((r) => r.ttft_s != null).map((r) => r.ttft_s * 1000),
            {xlabel: "TTFT (ms)"});
  histogram(figure("ITL distribution"), ok.flatMap((r) => r.itl_s.map((g) => g * 1000)),
            {xlabel: "inter-token latency (ms)"});
  const t0 = records.length ? Math.min(...records.map((r) => r.start_s)) : 0;
  const lat = figure("Latency over time");
  if (ok.length) {
    scatterChart(lat, [{label: "E2E latency", color: COLORS[0], points: ok.map((r) => [r.start_s - t0, r.e2el_s * 1000])},
                       {label: "TTFT", color: COLORS[1], points: ok.filter((r) => r.ttft_s != null)
                         .map((r) => [r.start_s - t0, r.ttft_s * 1000])}], {xlabel: "request sent at (s)"});
  } else noData(lat);
  const tp = figure("Throughput over time");
  const t = records.length ? throughput(records) : null;
  if (t) {
    // One axis: tokens/s, and requests in flight scaled onto it (its own scale in the legend).
    const maxTok = Math.max(1, ...t.tokens.map(([, v]) => v)), maxFlight = Math.max(1, ...t.flight.map(([, v]) => v));
    const scale = maxTok / maxFlight;
    lineChart(tp, [{label: "output tokens/s", color: COLORS[0], points: t.tokens.map(([x, v]) => [x - t0, v])},
                   {label: `requests in flight (x${scale.toPrecision(2)})`, color: COLORS[1],
                    points: t.flight.map(([x, v]) => [x - t0, v * scale])}], {xlabel: "time (s)"});
  } else noData(tp);
  const pts = ok.filter((r) => r.ttft_s != null).map((r) => [r.input_tokens, r.ttft_s * 1000]);
  const tv = figure("TTFT vs prompt length");
  if (pts.length) scatterChart(tv, [{label: "TTFT (ms)", color: COLORS[2], points: pts}], {xlabel: "prompt tokens"});
  else noData(tv);
  const cfgHead = document.createElement("div");
  cfgHead.innerHTML = `<h3>Configuration</h3><table>${config}</table>`;
  report.appendChild(cfgHead);
}

export function initBench() {
  const showError = (t) => { $("bench-error").textContent = t; $("bench-error").hidden = !t; };
  $("bench-file").addEventListener("change", async () => {
    const file = $("bench-file").files[0];
    if (!file) return;
    showError("");
    $("bench-report").replaceChildren();
    try {
      const result = JSON.parse(await file.text());
      if (!result || typeof result !== "object" || !("summary" in result)) {
        throw new Error("not a tokenmill bench result (no 'summary')");
      }
      await render(result);
    } catch (e) {
      showError(`${file.name}: ${e.message}`);
    }
  });
  return {};
}
