// Line, stacked-bar, scatter and histogram charts drawn on a <canvas> (no chart library): enough for the Live and
// Bench pages. Series: {label, color, points: [[x, y], ...]}.
export const COLORS = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb"];
const PAD = {left: 52, right: 12, top: 22, bottom: 34};  // the legend sits above the plot area

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function fmt(v) {
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
  if (a >= 10 || v === 0) return v.toFixed(0);
  return v.toPrecision(2);
}

function frame(canvas, opts) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, w, h);
  const [x0, x1] = opts.x, [y0, y1] = opts.y;
  const pw = w - PAD.left - PAD.right, ph = h - PAD.top - PAD.bottom;
  const sx = (x) => PAD.left + (x1 > x0 ? (x - x0) / (x1 - x0) : 0) * pw;
  const sy = (y) => PAD.top + ph - (y1 > y0 ? (y - y0) / (y1 - y0) : 0) * ph;
  ctx.strokeStyle = "#ddd";
  ctx.fillStyle = "#555";
  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  const ticks = opts.integer ? Math.max(1, Math.min(4, y1 - y0)) : 4;  // counts: whole-number gridlines
  for (let i = 0; i <= ticks; i++) {
    const y = y0 + (y1 - y0) * i / ticks;
    ctx.beginPath(); ctx.moveTo(PAD.left, sy(y)); ctx.lineTo(w - PAD.right, sy(y)); ctx.stroke();
    ctx.textAlign = "right"; ctx.fillText(opts.integer ? String(Math.round(y)) : fmt(y), PAD.left - 4, sy(y) + 4);
  }
  ctx.textAlign = "center";
  for (let i = 0; i <= 4; i++) {
    const x = x0 + (x1 - x0) * i / 4;
    ctx.fillText(opts.xfmt ? opts.xfmt(x) : fmt(x), sx(x), h - PAD.bottom + 14);
  }
  if (opts.xlabel) ctx.fillText(opts.xlabel, PAD.left + pw / 2, h - 4);
  return {ctx, sx, sy, w, h};
}

function legend(ctx, series, w) {
  let x = w - PAD.right;
  ctx.textAlign = "right";
  for (const s of [...series].reverse()) {
    const text = s.label;
    ctx.fillStyle = s.color;
    ctx.fillText(text, x, 12);
    x -= ctx.measureText(text).width + 14;
  }
}

function bounds(series, opts) {
  let xmin = Infinity, xmax = -Infinity, ymax = 0;
  for (const s of series) for (const [x, y] of s.points) {
    if (x < xmin) xmin = x; if (x > xmax) xmax = x; if (y > ymax) ymax = y;
  }
  if (opts.x) [xmin, xmax] = opts.x;
  if (!isFinite(xmin)) { xmin = 0; xmax = 1; }
  return {x: [xmin, xmax], y: [0, opts.ymax ?? niceMax(ymax)]};
}

export function lineChart(canvas, series, opts = {}) {
  const b = bounds(series, opts);
  const {ctx, sx, sy, w} = frame(canvas, {...opts, ...b});
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.6;
    ctx.beginPath();
    s.points.forEach(([x, y], i) => (i ? ctx.lineTo(sx(x), sy(y)) : ctx.moveTo(sx(x), sy(y))));
    ctx.stroke();
  }
  legend(ctx, series, w);
  canvas.dataset.points = String(series.reduce((n, s) => n + s.points.length, 0));
}

export function scatterChart(canvas, series, opts = {}) {
  const b = bounds(series, opts);
  const {ctx, sx, sy, w} = frame(canvas, {...opts, ...b});
  for (const s of series) {
    ctx.fillStyle = s.color;
    for (const [x, y] of s.points) ctx.fillRect(sx(x) - 1.5, sy(y) - 1.5, 3, 3);
  }
  legend(ctx, series, w);
  canvas.dataset.points = String(series.reduce((n, s) => n + s.points.length, 0));
}

// Stacked shares (0..1) per interval: bars = [{x0, x1, parts: [v, ...]}], parts in the order of `labels`.
export function stackedBars(canvas, bars, labels, colors, opts = {}) {
  const {ctx, sx, sy, w} = frame(canvas, {...opts, x: opts.x, y: [0, 1]});
  for (const bar of bars) {
    let base = 0;
    bar.parts.forEach((v, i) => {
      ctx.fillStyle = colors[i];
      const top = Math.min(1, base + v);
      ctx.fillRect(sx(bar.x0), sy(top), Math.max(1, sx(bar.x1) - sx(bar.x0) - 1), sy(base) - sy(top));
      base = top;
    });
  }
  legend(ctx, labels.map((label, i) => ({label, color: colors[i]})), w);
  canvas.dataset.points = String(bars.length);
}

export function histogram(canvas, values, opts = {}) {
  if (!values.length) return noData(canvas);
  const lo = Math.min(...values), hi = Math.max(...values);
  const n = Math.min(60, Math.max(5, Math.floor(Math.sqrt(values.length)) * 2));  // as the HTML report's bins
  const width = (hi - lo) / n || 1;
  const counts = new Array(n).fill(0);
  for (const v of values) counts[Math.min(n - 1, Math.floor((v - lo) / width))]++;
  const top = 4 * Math.ceil(Math.max(...counts) / 4);  // a multiple of the 4 gridlines
  const {ctx, sx, sy} = frame(canvas, {...opts, integer: true, x: [lo, lo + width * n], y: [0, top]});
  ctx.fillStyle = COLORS[0];
  counts.forEach((c, i) => {
    const x0 = sx(lo + i * width), x1 = sx(lo + (i + 1) * width);
    ctx.fillRect(x0, sy(c), Math.max(1, x1 - x0 - 1), sy(0) - sy(c));
  });
  canvas.dataset.points = String(values.length);
}

export function noData(canvas) {
  const {ctx, w, h} = frame(canvas, {x: [0, 1], y: [0, 1]});
  ctx.fillStyle = "#888"; ctx.textAlign = "center"; ctx.font = "14px system-ui, sans-serif";
  ctx.fillText("no data", w / 2, h / 2);
  canvas.dataset.points = "0";
}
