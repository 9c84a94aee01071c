// Prometheus text exposition -> {name: [{labels, value}]}, and what the Live page derives from two scrapes.
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    if (m[3]) for (const l of m[3].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    (out[m[1]] ??= []).push({labels, value: parseFloat(m[4])});
  }
  return out;
}

// The sum of a metric's samples (over its model_name etc.), filtered by labels.
export function total(metrics, name, where = {}) {
  let s = 0;
  for (const sample of metrics[name] || []) {
    if (Object.entries(where).every(([k, v]) => sample.labels[k] === v)) s += sample.value;
  }
  return s;
}

// A histogram's cumulative buckets: [[le, count], ...] sorted by le (summed over other labels).
export function buckets(metrics, name) {
  const by = new Map();
  for (const s of metrics[name + "_bucket"] || []) {
    const le = s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le);
    by.set(le, (by.get(le) || 0) + s.value);
  }
  return [...by.entries()].sort((a, b) => a[0] - b[0]);
}

// The q-quantile of the observations between two scrapes, interpolated within a bucket as PromQL's
// histogram_quantile does; null when nothing was observed.
export function quantile(q, older, newer) {
  const diff = newer.map(([le, c], i) => [le, c - (older[i] ? older[i][1] : 0)]);
  const n = diff.length ? diff[diff.length - 1][1] : 0;
  if (!(n > 0)) return null;
  const rank = q * n;
  let prevLe = 0, prevC = 0;
  for (const [le, c] of diff) {
    if (c >= rank) {
      if (le === Infinity) return prevLe;
      return prevLe + (le - prevLe) * (c > prevC ? (rank - prevC) / (c - prevC) : 0);
    }
    prevLe = le; prevC = c;
  }
  return prevLe;
}
