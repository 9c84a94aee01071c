"""Text for people: the "where the time went" report of a diagnose / engine_diagnostics result (the JSON is
that dict itself), its attention line, and how the start-up log names streamed weights.
"""
from __future__ import annotations


def streamed_where(weights: dict) -> str:
    """How the start-up log names a store's streamed bytes, from its describe()."""
    return "streamed from disk per step" if weights["source"] == "disk" else "in host memory, copied per step"



def format_report(d: dict) -> str:
    t = d["time_s"]
    lines = [f"where the time went ({d['steps']} steps, {d['tokens']} tokens, {d['tokens_per_step']:.1f} tokens/step):"]
    for k in ("schedule", "offload", "prepare", "forward", "sample", "detokenize", "idle"):
        lines.append(f"  {k:<11} {t[k]:8.3f} s  {100 * d['time_share'][k]:5.1f}%")
    w = d.get("weight_wait") or {}
    if w.get("time_s"):  # part of forward: its own line, so the kernels are not blamed for it
        lines.append(f"  (of forward, waiting for streamed weights {w['time_s']:.3f} s, "
                     f"{100 * w['share_of_busy']:.1f}% of busy)")
    a, p = d["achieved"], d["peaks"]
    lines.append(f"  achieved in forward: {a['flops_per_s'] / 1e9:.1f} GFLOP/s ({100 * a['flops_share_of_peak']:.0f}% of "
                 f"{p['flops'] / 1e9:.0f} peak), {a['bytes_per_s'] / 1e9:.1f} GB/s ({100 * a['bandwidth_share_of_peak']:.0f}% "
                 f"of {p['bandwidth'] / 1e9:.0f} peak)")
    lines.append(format_attention(d["attention"], p["bandwidth"]))
    c = d.get("calibration") or {}
    if c.get("note"):
        lines.append(f"  calibration{' (STALE)' if c.get('stale') else ''}: {c['note']}")
    lines.append(f"  verdict: {d['verdict']} — {d['reason']}")
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_attention(a: dict, peak_bandwidth: float) -> str:
    read = f"{_size(a['bytes_per_step'])} K/V read/step"
    if not a["timed"]:
        return f"  attention: not timed ({read}; TOKENMILL_TIME_ATTENTION=1 times it on CUDA, syncing every layer)"
    return (f"  attention: {1e3 * a['s_per_step']:.3f} ms/step ({100 * (a['share_of_forward'] or 0):.0f}% of forward), "
            f"{read}, {a['bytes_per_s'] / 1e9:.2f} GB/s ({100 * (a['bandwidth_share_of_peak'] or 0):.0f}% of "
            f"{peak_bandwidth / 1e9:.0f} calibrated)")
