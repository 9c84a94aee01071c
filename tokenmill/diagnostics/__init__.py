"""Where the time goes: per-step timings against this machine's measured peaks (a roofline).

For a window of engine steps we know the time split (schedule, prepare, forward, sample, detokenize,
idle), the tokens processed and the attention work. From the model's shape we know the FLOPs and the
bytes those steps must move at least (weights once per step, the KV cache they read and write). With
the machine's peak FLOP/s and memory bandwidth — measured by a short calibration and cached, and
re-measured when the engine beats them or they were measured on a busy machine — the minimum time is
max(FLOPs / peak, bytes / bandwidth), and the report says which bound the run is under.

One job per module:
- calibration: micro-benchmarks of the machine's peaks, the calibration cache file, its locking and the load
  rules that decide when a stored calibration is trusted or re-measured.
- analysis: per-step roofline analysis (ModelCost, achieved rates, attention, streamed weights) and the verdict;
  engine_diagnostics over an engine's recent steps.
- report: text formatting of a report (the JSON is the report dict itself).

This package re-exports their public names. A module constant or function looked up at call time
(measure_peaks, RECALIBRATE_INTERVAL_S, ...) is patched on the module that defines it, not here.
"""
from tokenmill.diagnostics.analysis import (
    ROOFLINE_SHARE_FOR_BOUND,
    STREAM_VERDICTS,
    WEIGHT_WAIT_SHARE_FOR_BOUND,
    ModelCost,
    attention_summary,
    diagnose,
    engine_diagnostics,
    observed_rates,
    resident_weight_bytes,
    streamed_parameters,
    weight_stream_report,
)
from tokenmill.diagnostics.calibration import (
    CALIBRATION_VERSION,
    LOAD_AVERAGE_WINDOW_S,
    LOADED_SHARE_OF_CPUS,
    RECALIBRATE_INTERVAL_S,
    Calibration,
    Peaks,
    calibrate,
    cpu_name,
    load_or_measure_peaks,
    measure_peaks,
)
from tokenmill.diagnostics.report import format_attention, format_report, streamed_where

__all__ = [
    "CALIBRATION_VERSION", "LOAD_AVERAGE_WINDOW_S", "LOADED_SHARE_OF_CPUS", "RECALIBRATE_INTERVAL_S",
    "ROOFLINE_SHARE_FOR_BOUND", "STREAM_VERDICTS", "WEIGHT_WAIT_SHARE_FOR_BOUND",
    "Calibration", "ModelCost", "Peaks",
    "attention_summary", "calibrate", "cpu_name", "diagnose", "engine_diagnostics", "format_attention",
    "format_report", "load_or_measure_peaks", "measure_peaks", "observed_rates", "resident_weight_bytes",
    "streamed_parameters", "streamed_where", "weight_stream_report",
]
