"""Batched, vectorised token sampler.

One call samples one token for each of B rows of logits [B, V], with per-row sampling
parameters carried as tensors in `SamplingMetadata` (built once per engine step).

Order of operations (vLLM / OpenAI / transformers semantics):
  logit_bias -> banned tokens -> grammar bitmask (structured output) -> repetition penalty -> presence/frequency penalties
  -> greedy rows: argmax
  -> random rows: temperature -> top-k -> top-p -> min-p -> sample
Logprobs are always computed from the raw input logits (vLLM's default).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tokenmill.sample.argmax import row_argmax
from tokenmill.sample.draws import SAMPLE_STREAM, UNSEEDED, inverse_cdf, row_uniforms
from tokenmill.sampling_params import SamplingParams

# Cumulative float32 sums that miss top_p only by rounding still count as reaching it,
# so a set whose mass is exactly top_p is not extended by one token.
_TOP_P_EPS = 1e-6


@dataclass
class SamplingMetadata:
    temperature: Tensor  # [B] float32; 0 => greedy row
    top_k: Tensor  # [B] int64; 0 => disabled
    top_p: Tensor  # [B] float32; 1.0 => disabled
    min_p: Tensor  # [B] float32; 0.0 => disabled
    repetition_penalty: Tensor  # [B] float32
    presence_penalty: Tensor  # [B] float32
    frequency_penalty: Tensor  # [B] float32
    prompt_mask: Tensor | None  # [B, V] bool; None if no row uses repetition penalty
    output_counts: Tensor | None  # [B, V] float32; None if no row uses any penalty
    logit_bias: Tensor | None  # [B, V] float32 additive bias
    banned: Tensor | None  # [B, V] bool, forced to -inf (min_tokens)
    # Per row: the key of its seeded draws (draws.position_seed of the output position it samples), or
    # UNSEEDED (-1) for the global generator; None when no row is seeded.
    seeds: Tensor | None
    all_greedy: bool
    max_num_logprobs: int  # top-N size; 0 => no top logprobs
    # Additions. The filter flags are Python bools so the hot path needs no device sync to
    # decide whether to sort; True is always correct (a disabled row's filter is a no-op).
    need_logprobs: bool = False  # some row wants the sampled token's logprob (even with N=0)
    use_top_k: bool = True
    use_top_p: bool = True
    use_min_p: bool = True
    # Structured output: rows under a grammar, and for each its allowed tokens ([rows, ceil(V/32)] int32,
    # bit t%32 of word t//32 set = token t allowed), filled by the engine core.
    grammar_rows: Tensor | None = None
    grammar_bitmask: Tensor | None = None
    # Every row seeded (its draws need no global generator), known on the host so that the draws need not read
    # the keys back from the device to find out.
    all_seeded: bool = False

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        seeds: list[int | None],
        banned_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Build the step's tensors. Out-of-range token ids (prompt, output, bias, banned)
        are ignored, like transformers does; user input should be validated on admission."""
        V = vocab_size
        greedy = [p.greedy for p in params]
        random_rows = [p for p, g in zip(params, greedy) if not g]

        def vec(values: list[float], dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_pf = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        prompt_mask = output_counts = logit_bias = banned = None
        if use_rep:
            prompt_mask = _scatter_rows(prompt_token_ids, None, V, torch.bool, device)
        if use_rep or use_pf:
            output_counts = _scatter_rows(output_token_ids, None, V, torch.float32, device)
        if any(p.logit_bias for p in params):
            biases = [p.logit_bias or {} for p in params]
            logit_bias = _scatter_rows(
                [[int(t) for t in b] for b in biases],
                [[float(v) for v in b.values()] for b in biases],
                V,
                torch.float32,
                device,
            )
        if any(banned_token_ids):
            banned = _scatter_rows(banned_token_ids, None, V, torch.bool, device)

        return cls(
            temperature=vec([0.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            top_k=vec([p.top_k for p in params], torch.int64),
            top_p=vec([p.top_p for p in params], torch.float32),
            min_p=vec([p.min_p for p in params], torch.float32),
            repetition_penalty=vec([p.repetition_penalty for p in params], torch.float32),
            presence_penalty=vec([p.presence_penalty for p in params], torch.float32),
            frequency_penalty=vec([p.frequency_penalty for p in params], torch.float32),
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            logit_bias=logit_bias,
            banned=banned,
            seeds=None if all(s is None for s in seeds) else
            vec([UNSEEDED if s is None else s for s in seeds], torch.int64),
            all_greedy=all(greedy),
            all_seeded=all(s is not None for s in seeds),
            max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            need_logprobs=any(p.logprobs is not None for p in params),
            use_top_k=any(0 < p.top_k < V for p in random_rows),
            use_top_p=any(p.top_p < 1.0 for p in random_rows),
            use_min_p=any(p.min_p > 0.0 for p in random_rows),
        )


def _scatter_rows(
    ids: list[list[int]],
    values: list[list[float]] | None,
    vocab_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> Tensor:
    """Scatter ragged per-row id lists into a dense [B, V] tensor.

    bool: True where an id occurs; float: per-id sum of `values` (or occurrence counts when
    values is None). Padding and out-of-range ids go to an extra column that is sliced off,
    so they can never collide with a real token.
    """
    B, V = len(ids), vocab_size
    width = max((len(r) for r in ids), default=0)
    index = torch.tensor([[*r, *[V] * (width - len(r))] for r in ids], dtype=torch.int64).reshape(B, width)
    index = index.masked_fill((index < 0) | (index > V), V).to(device)
    out = torch.zeros(B, V + 1, dtype=dtype, device=device)
    if dtype == torch.bool:
        out.scatter_(1, index, True)
    else:
        if values is None:
            src = torch.ones(B, width, dtype=dtype, device=device)
        else:
            src = torch.tensor([[*v, *[0.0] * (width - len(v))] for v in values], dtype=dtype).reshape(B, width)
            src = src.to(device)
        out.scatter_add_(1, index, src)
    return out[:, :V].contiguous()


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] float32 raw logprob of the sampled token
    top_logprobs: Tensor | None  # [B, N] float32, descending
    top_ids: Tensor | None  # [B, N] int64
    ranks: Tensor | None  # [B] int64, 1 = most likely

    def to_host(self, extra: Tensor | None = None) -> tuple[list[int], tuple[list, list, list, list] | None,
                                                             list[int] | None]:
        """(token ids, (logprobs, ranks, top ids, top logprobs) or None, `extra` as a list or None: the
        verification's accepted counts) as Python lists, with one device-to-host copy: everything is packed into
        one float64 tensor first (ids, ranks and counts are below 2^53, float32 logprobs widen exactly), instead
        of a copy per tensor (each a device sync on a GPU)."""
        B = self.token_ids.shape[0]
        parts = [self.token_ids.double()]
        if self.logprobs is not None:
            n = self.top_ids.shape[1]
            parts += [self.logprobs.double(), self.ranks.double(), self.top_ids.double().reshape(-1),
                      self.top_logprobs.double().reshape(-1)]
        if extra is not None:
            parts.append(extra.double())
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
        tokens = host[:B].astype(np.int64).tolist()
        at, lp = B, None
        if self.logprobs is not None:
            lp = (host[at : at + B].tolist(), host[at + B : at + 2 * B].astype(np.int64).tolist(),
                  host[at + 2 * B : at + 2 * B + B * n].astype(np.int64).reshape(B, n).tolist(),
                  host[at + 2 * B + B * n : at + 2 * B + 2 * B * n].reshape(B, n).tolist())
            at += 2 * B + 2 * B * n
        return tokens, lp, (host[at:].astype(np.int64).tolist() if extra is not None else None)


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(token logprob [T], top logprobs [T, num_top], top ids [T, num_top], rank [T]) of
    log_softmax(logits) in float32. Rank is 1 + the number of strictly more likely tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    token_lp = logprobs.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    top_lp, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    ranks = (logprobs > token_lp.unsqueeze(-1)).sum(dim=-1) + 1
    return token_lp, top_lp, top_ids, ranks


_BITS: dict[torch.device, Tensor] = {}


def _byte_bits(device: torch.device) -> Tensor:
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=device)
    return bits


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[rows, W] int32 words -> [rows, vocab_size] bool, True = allowed (bit t%32 of word t//32)."""
    rows = bitmask.shape[0]
    if sys.byteorder == "little":
        # Bit t%32 of word t//32 is bit t%8 of byte t//8: one AND over bytes, cheaper than int32 shifts.
        bits = bitmask.contiguous().view(torch.uint8).unsqueeze(-1) & _byte_bits(bitmask.device)
    else:
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    return (bits != 0).view(rows, -1)[:, :vocab_size]


def apply_bitmask(x: Tensor, rows: Tensor, bitmask: Tensor) -> Tensor:
    """x with the tokens `bitmask` disallows set to -inf in `rows` (out of place: x may be the raw logits)."""
    allowed = unpack_bitmask(bitmask, x.shape[-1])
    neg = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if rows.numel() != x.shape[0]:  # else every row is constrained (rows are the batch rows in order)
        allowed = torch.ones(x.shape, dtype=torch.bool, device=x.device).index_put_((rows,), allowed)
    return torch.where(allowed, x, neg)


def apply_penalties(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """logit_bias, banned tokens, repetition and presence/frequency penalties (out of place)."""
    x = logits.float()
    if meta.logit_bias is not None:
        x = x + meta.logit_bias
    if meta.banned is not None:
        x = x.masked_fill(meta.banned, float("-inf"))
    if meta.grammar_bitmask is not None:
        x = apply_bitmask(x, meta.grammar_rows, meta.grammar_bitmask)
    if meta.prompt_mask is not None:
        seen = meta.prompt_mask
        if meta.output_counts is not None:
            seen = seen | (meta.output_counts > 0)
        p = meta.repetition_penalty.unsqueeze(1)
        x = torch.where(seen, torch.where(x < 0, x * p, x / p), x)
    if meta.output_counts is not None:
        counts = meta.output_counts
        x = (
            x
            - meta.frequency_penalty.unsqueeze(1) * counts
            - meta.presence_penalty.unsqueeze(1) * (counts > 0).float()
        )
    return x


def apply_top_k_top_p_min_p(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Set filtered-out entries to -inf; top-k, then top-p on the renormalised top-k set,
    then min-p. Ties at the top-k threshold are all kept (as in transformers/vLLM); ties
    inside top-p are broken by lower token id."""
    remove = None
    if meta.use_top_k or meta.use_top_p:
        remove = _top_k_top_p_mask(logits, meta.top_k, meta.top_p)
    if meta.use_min_p:
        # p_i / p_max is unchanged by renormalisation and the top token survives top-k/p,
        # so min-p on the unfiltered distribution equals min-p applied last.
        probs = logits.softmax(dim=-1)
        low = probs < meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        remove = low if remove is None else remove | low
    return logits if remove is None else logits.masked_fill(remove, float("-inf"))


def _top_k_top_p_mask(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    remove = sorted_logits < kth
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly higher-ranked tokens
    threshold = torch.where(top_p < 1.0, top_p - _TOP_P_EPS, float("inf")).unsqueeze(1)
    remove |= mass_before >= threshold
    remove[:, 0] = False  # the most likely token always survives
    return torch.empty_like(remove).scatter_(1, order, remove)


def target_distribution(logits: Tensor, meta: SamplingMetadata) -> tuple[Tensor, Tensor, Tensor | None]:
    """(raw float32 logits, the greedy token of each row (argmax after penalties), the distribution to
    sample from (penalties, temperature, top-k/top-p/min-p; None when every row is greedy)). Shared by the
    sampler and the speculative verifier, so drafts are judged against exactly what would be sampled."""
    raw = logits.float()
    x = apply_penalties(raw, meta)
    greedy_ids = row_argmax(x)
    if meta.all_greedy:
        return raw, greedy_ids, None
    temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature).unsqueeze(1)
    return raw, greedy_ids, apply_top_k_top_p_min_p(x / temperature, meta).softmax(dim=-1)


class Sampler:
    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw, token_ids, probs = target_distribution(logits, meta)
        if probs is not None:
            # One uniform per row, inverted through the row's cumulative distribution (draws.py).
            sampled = inverse_cdf(probs, row_uniforms(meta.seeds, probs.shape[0], SAMPLE_STREAM, probs.device,
                                                         meta.all_seeded))
            token_ids = torch.where(meta.temperature == 0, token_ids, sampled)
        return self.output(raw, token_ids, meta)

    @staticmethod
    def output(raw: Tensor, token_ids: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """The chosen tokens, with their logprobs when any row asked for them."""
        if meta.max_num_logprobs > 0 or meta.need_logprobs:
            token_lp, top_lp, top_ids, ranks = compute_logprobs(raw, token_ids, meta.max_num_logprobs)
            return SamplerOutput(token_ids, token_lp, top_lp, top_ids, ranks)
        return SamplerOutput(token_ids, None, None, None, None)
