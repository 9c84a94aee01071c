"""The sampler's random numbers: one uniform per sampled row, never a vocabulary's worth.

A token is drawn from its row's distribution by inverting the cumulative sum (one uniform per row) rather
than by an exponential race (one draw per vocabulary entry: 49,152 for SmolLM2, and per seeded row a
separate generator call). Seeded rows take their uniform from a counter-based hash of (seed, output
position, stream), computed for every seeded row of the step in one batched op: a request draws the same
numbers alone or in any batch, after a preemption, or re-sent after a failed step, with no generator state
to carry or reseed. Unseeded rows draw from the global generator in one call.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

UNSEEDED = -1  # a row key for rows that draw from the global generator (position keys are >= 0)

# Streams: the numbers one row may need in one step, kept apart.
SAMPLE_STREAM = 0  # the token drawn from the row's (or the residual) distribution
ACCEPT_STREAM = 1  # the speculative acceptance test of the row's draft

_MASK63 = (1 << 63) - 1
_SEED_MUL = 0x9E3779B97F4A7C15
_POS_MUL = 0xBF58476D1CE4E5B9
# splitmix64's constants as the int64 values with the same bits (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def position_seed(seed: int, position: int) -> int:
    """The key of a seeded request's draws for its output token `position`: a function of (seed, position)
    alone, so a request that is preempted, or re-sent after a failed step, draws what it would have drawn
    running uninterrupted."""
    return (seed * _SEED_MUL + position * _POS_MUL) & _MASK63


def position_seeds(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """position_seed over arrays (uint64 arithmetic wraps mod 2^64, and 2^63 divides it); int64 keys."""
    with np.errstate(over="ignore"):
        k = seeds.astype(np.uint64) * np.uint64(_SEED_MUL) + positions.astype(np.uint64) * np.uint64(_POS_MUL)
    return (k & np.uint64(_MASK63)).astype(np.int64)


def _as_int64(v: int) -> int:
    """The int64 with v's low 64 bits."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def counter_uniforms(keys: Tensor, stream: int) -> Tensor:
    """U[0, 1) in float64 per key: splitmix64's output function of key + (stream + 1) * golden ratio, the
    top 53 bits. Integer multiplies wrap mod 2^64 as the hash needs."""
    z = keys + _as_int64((stream + 1) * _GOLDEN)
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * (1.0 / (1 << 53))


def row_uniforms(keys: Tensor | None, rows: int, stream: int, device, all_seeded: bool | None = None) -> Tensor:
    """One U[0, 1) per row (float64): the counter hash for seeded rows, the global generator for the rest.
    `all_seeded`: whether every key is seeded, when the caller knows it on the host (None: read from the keys,
    a device sync on a GPU)."""
    if keys is None:
        return torch.rand(rows, dtype=torch.float64, device=device)
    seeded = keys >= 0
    hashed = counter_uniforms(keys, stream)
    if all_seeded is None:
        all_seeded = bool(seeded.all())
    if all_seeded:
        return hashed
    return torch.where(seeded, hashed, torch.rand(rows, dtype=torch.float64, device=device))


def inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Per row, the token i with cdf[i-1] <= u * total < cdf[i] over non-negative weights [R, V] (need not sum
    to 1): an exact draw from the normalised weights, never a zero-weight token. The cumulative sum is in
    float64 so that rounding over a large vocabulary shifts no token's share measurably."""
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    idx = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True).squeeze(1)
    # u * total may round up to total: the last token with weight is the draw then.
    return torch.minimum(idx, (cdf < total).sum(dim=-1))


def generator_uniforms(generators: list[torch.Generator | None], device) -> Tensor:
    """One U[0, 1) per row (float64) from the row's own generator, or the global one where None. For draws
    made several times in one step (a draft model's k proposals), where the generator's advancing state
    keeps them apart; one call per seeded row, not per vocabulary entry."""
    u = torch.rand(len(generators), dtype=torch.float64, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=g)[0]
    return u
