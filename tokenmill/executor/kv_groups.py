"""KV cache groups: which attention layers share a block table, and the pool tensors they share.

A model whose layers differ in attention window (Gemma 3: five sliding-window layers per full one) gets one
group per window type, and every group the same number of layers G (the greatest common divisor of the
types' layer counts), so one block is the K/V of block_size tokens for G layers in every group. The pool is
G tensor pairs; a group's i-th layer reads and writes the i-th. The core keeps a block table per group
(core/kv_cache.py) and releases a windowed group's blocks once they slide out of its window, while the full
group keeps its own: a long request holds its whole context in one group and about a window in the others.

One group when every layer has the same window (Mistral: blocks out of the window are released from the one
table), when no layer has one, or when groups are off: `--disable-hybrid-kv-cache-manager`, and what does not
work with them yet (the KV connector hands over whole prefixes; a pipeline stage holds some layers only; layers
of different K/V shapes). KV offloading works with groups: a block of any group is rows of the same pool
tensors, saved and loaded under its group's prefix-cache key. `off_reasons` names them. A speculative drafter keeps its K/V in
the blocks of the first group's table, so it needs that group to be a full-attention one (it is whenever the
model has full layers: they come first); a model whose every layer slides keeps all blocks with a drafter.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from tokenmill.layers.attention import Attention

log = logging.getLogger(__name__)


@dataclass
class KVGroup:
    window: int | None  # the layers' sliding window (None: full attention)
    layers: list[Attention]


@dataclass
class OffReasons:
    """Why blocks are never released (`release`), why windows cannot have groups of their own (`groups`), and why
    the first group must attend to the whole context (`full_first`); None: no reason."""

    release: str | None = None
    groups: str | None = None
    full_first: str | None = None


def off_reasons(config, spec) -> OffReasons:
    if config.scheduler.disable_hybrid_kv_cache_manager:
        return OffReasons("--disable-hybrid-kv-cache-manager", "--disable-hybrid-kv-cache-manager")
    full_first = "speculative decoding (its drafter's K/V lives in the first group's blocks)" if spec else None
    return OffReasons(*_off(config), full_first)


def _off(config) -> tuple[str | None, str | None]:
    if config.kv_transfer is not None:
        return "a KV connector (it hands over whole prefixes)", "a KV connector"
    if config.parallel.pipeline_parallel_size > 1:
        return None, "pipeline parallelism (a stage holds some layers only)"
    return None, None


def plan_kv_groups(layers: list[Attention], model_windows: set[int | None], off: OffReasons) -> list[KVGroup]:
    """The groups of this process's attention layers. `model_windows`: every window of the whole model (a
    pipeline stage holds only some of its layers)."""
    if off.full_first is not None and None not in model_windows:
        log.info("KV cache: every layer keeps the whole context (%s)", off.full_first)
        return [KVGroup(None, list(layers))]
    release_off, groups_off = off.release, off.groups
    if release_off is not None or None in model_windows and len(model_windows) == 1:
        return [KVGroup(None, list(layers))]
    if len(model_windows) == 1:  # one window everywhere: one table, released as it slides
        return [KVGroup(next(iter(model_windows)), list(layers))]
    why = groups_off
    if why is None and len({(a.num_kv_heads, a.head_dim) for a in layers}) > 1:
        why = "layers with different K/V shapes"
    if why is not None:
        log.info("KV cache: every layer keeps the whole context (layers with different attention windows need "
                 "KV cache groups, off with %s)", why)
        return [KVGroup(None, list(layers))]
    by_window: dict[int | None, list[Attention]] = {}
    for a in layers:
        by_window.setdefault(a.sliding_window, []).append(a)
    size = math.gcd(*(len(v) for v in by_window.values()))
    groups = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):  # full attention first
        same = by_window[window]
        groups += [KVGroup(window, same[i : i + size]) for i in range(0, len(same), size)]
    return groups


def share_kv_cache(groups: list[KVGroup]) -> None:
    """After the backend allocated the first group's caches: every other group's i-th layer uses the first
    group's i-th layer's tensors (K, V, int8's scales). fp8's per-layer scales stay the layer's own."""
    first = groups[0].layers
    for group in groups[1:]:
        for src, dst in zip(first, group.layers, strict=True):
            dst.k_cache, dst.v_cache = src.k_cache, src.v_cache
            dst.k_scale_cache, dst.v_scale_cache = src.k_scale_cache, src.v_scale_cache
            dst.backend = src.backend


def describe(groups: list[KVGroup]) -> str:
    """For the start-up log: the groups by window."""
    if len(groups) == 1:
        w = groups[0].window
        return "one block table" + (f", blocks released out of the {w}-token window" if w else "")
    counts: dict[int | None, int] = {}
    for g in groups:
        counts[g.window] = counts.get(g.window, 0) + 1
    kinds = ", ".join(f"{n} {'full' if w is None else f'window {w}'}" for w, n in counts.items())
    return f"{len(groups)} groups of {len(groups[0].layers)} layer(s) ({kinds}), one pool"
