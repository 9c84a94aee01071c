// Live: polls /metrics (and /v1/diagnostics for the steps run since the last poll) and charts the last minutes:
// tokens/s in and out, running / waiting / preempted requests, KV usage and prefix hit rate, TTFT and ITL
// percentiles, and where the step time went against the machine's measured peaks. Both routes are the internal
// role's (the internal or the admin key); a tenant key gets a note saying so.
import {getText, getJSON} from "/ui/api.js";
import {COLORS, lineChart, noData, stackedBars} from "/ui/plot.js";
import {buckets, parseMetrics, quantile, total} from "/ui/prom.js";

const $ = (id) => document.getElementById(id);
const P = "tokenmill:";
const LATENCY_WINDOW_S = 60;
const MAX_STEPS = 2000;  // diagnostics over at most this many steps per poll

function scrape(text) {
  const m = parseMetrics(text);
  return {
    t: Date.now() / 1000,
    prompt: total(m, P + "prompt_tokens_total"), gen: total(m, P + "generation_tokens_total"),
    running: total(m, P + "num_requests_running"), waiting: total(m, P + "num_requests_waiting"),
    preempt: total(m, P + "num_preemptions_total"), kv: total(m, P + "kv_cache_usage_perc"),
    hits: total(m, P + "prefix_cache_hits_total"), queries: total(m, P + "prefix_cache_queries_total"),
    steps: total(m, P + "iteration_tokens_total_count"),
    ttft: buckets(m, P + "time_to_first_token_seconds"), itl: buckets(m, P + "inter_token_latency_seconds"),
  };
}

export function initLive() {
  const samples = [];  // scrapes, oldest first
  const points = [];   // derived per interval: {t, in, out, running, waiting, preempt, kv, hit, ttft, itl}
  const roof = [];     // {t0, t1, compute, bandwidth, overhead, verdict}
  let timer = null, busy = false, stopped = false;

  function note(text) { $("live-note").textContent = text; $("live-note").hidden = !text; }

  function derive(a, b) {
    const dt = b.t - a.t;
    const old = samples.find((s) => s.t >= b.t - LATENCY_WINDOW_S) || a;
    const q = (h, p) => { const v = quantile(p, old[h], b[h]); return v == null ? null : v * 1000; };
    return {t: b.t, in: Math.max(0, b.prompt - a.prompt) / dt, out: Math.max(0, b.gen - a.gen) / dt,
            running: b.running, waiting: b.waiting, preempt: Math.max(0, b.preempt - a.preempt) / dt,
            kv: b.kv * 100, hit: b.queries > a.queries ? 100 * (b.hits - a.hits) / (b.queries - a.queries) : null,
            ttft50: q("ttft", 0.5), ttft90: q("ttft", 0.9), ttft99: q("ttft", 0.99),
            itl50: q("itl", 0.5), itl99: q("itl", 0.99)};
  }

  async function roofline(a, b) {
    const n = Math.round(b.steps - a.steps);
    if (n <= 0) return;  // no step ran: nothing to split
    const d = await getJSON("/v1/diagnostics?last_n=" + Math.min(n, MAX_STEPS));
    const busyS = d.time_s.busy;
    if (!(busyS > 0)) return;
    const c = d.roofline.compute_s / busyS, m = d.roofline.memory_s / busyS;
    const bound = Math.min(1, Math.max(c, m));
    roof.push({t0: a.t, t1: b.t, compute: c >= m ? bound : 0, bandwidth: m > c ? bound : 0,
               overhead: 1 - bound, verdict: d.verdict, reason: d.reason});
    const p = d.peaks;
    $("live-peaks").textContent = `Measured peaks (${p.device}, ${p.dtype}, ${p.threads} thread(s)): ` +
      `${(p.flops / 1e9).toFixed(1)} GFLOP/s, ${(p.bandwidth / 1e9).toFixed(1)} GB/s. ` +
      `Last ${d.steps} step(s): ${d.verdict}.`;
    $("live-verdict").textContent = d.reason;
  }

  function draw() {
    const windowS = parseInt($("live-window").value, 10);
    const now = Date.now() / 1000;
    // The window, or less while the page has not watched that long (the charts fill their width from the start).
    const first = samples.length ? samples[0].t : now;
    const x = [Math.max(now - windowS, Math.min(first, now - 10)), now];
    const xfmt = (t) => `-${Math.round(now - t)} s`;
    const recent = points.filter((p) => p.t >= x[0]);
    const series = (keys) => keys.map(([key, label], i) => ({label, color: COLORS[i],
      points: recent.filter((p) => p[key] != null).map((p) => [p.t, p[key]])}));
    const opts = {x, xfmt};
    lineChart($("chart-tokens"), series([["in", "prompt tokens/s"], ["out", "generated tokens/s"]]), opts);
    lineChart($("chart-requests"), series([["running", "running"], ["waiting", "waiting"],
                                            ["preempt", "preempted/s"]]), opts);
    lineChart($("chart-kv"), series([["kv", "KV cache used"], ["hit", "prefix hit rate"]]), {...opts, ymax: 100});
    lineChart($("chart-latency"), series([["ttft50", "TTFT p50"], ["ttft90", "TTFT p90"], ["ttft99", "TTFT p99"],
                                          ["itl50", "ITL p50"], ["itl99", "ITL p99"]]), opts);
    const bars = roof.filter((r) => r.t1 >= x[0])
      .map((r) => ({x0: Math.max(r.t0, x[0]), x1: r.t1, parts: [r.compute, r.bandwidth, r.overhead]}));
    if (bars.length) stackedBars($("chart-roofline"), bars, ["compute", "bandwidth", "overhead"],
                                 [COLORS[0], COLORS[2], COLORS[1]], opts);
    else noData($("chart-roofline"));
  }

  async function poll() {
    if (busy) return;
    busy = true;
    try {
      const s = scrape(await getText("/metrics"));
      const prev = samples[samples.length - 1];
      samples.push(s);
      while (samples.length && samples[0].t < s.t - 3600) samples.shift();
      if (prev) {
        points.push(derive(prev, s));
        await roofline(prev, s);
      }
      note("");
      $("live-status").textContent = "updated " + new Date().toLocaleTimeString();
      const p = points[points.length - 1];
      if (p) {
        $("live-now").textContent = `now: ${p.in.toFixed(1)} prompt tokens/s, ${p.out.toFixed(1)} generated tokens/s, ` +
          `${p.running} running, ${p.waiting} waiting, KV cache ${p.kv.toFixed(1)} % used`;
        Object.assign($("live-now").dataset, {out: p.out, running: p.running});
      }
      draw();
    } catch (e) {
      if (e.status === 401 || e.status === 403) {
        note(`The Live page needs the internal or admin key (${e.status}: ${e.message})`);
        stop();  // no point asking again with this key
      } else {
        note("Live: " + e.message);
      }
    } finally {
      busy = false;
    }
  }

  function start() {
    stop();
    stopped = false;
    poll();
    timer = setInterval(poll, parseInt($("live-interval").value, 10));
  }
  function stop() { if (timer) clearInterval(timer); timer = null; stopped = true; }

  $("live-interval").addEventListener("change", () => { if (!stopped) start(); });
  $("live-window").addEventListener("change", draw);
  return {
    enter: start,
    leave: stop,
    keyChanged() { samples.length = 0; points.length = 0; roof.length = 0; },
  };
}
