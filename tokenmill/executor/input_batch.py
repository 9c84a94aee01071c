"""The worker's copy of the running requests, updated from each ScheduledBatch, and the step's tensors.

The core sends a request in full once and then only diffs (core/batch.py); this file applies them and
turns the batch into the packed, unpadded tensors the model and the attention backend read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from tokenmill.core.batch import ScheduledBatch
from tokenmill.layers.attention_backends.base import BatchLayout
from tokenmill.sample.draws import position_seed
from tokenmill.sample.sampler import SamplingMetadata
from tokenmill.sample.state import SamplingState
from tokenmill.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # accepted tokens: prompt + output
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    # Seeded requests: a generator for a draft model's draws, reseeded by output position before each step (the
    # sampler itself needs none: its seeded draws are counter-based, sample/draws.py).
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    sampling_slot: int = -1  # the request's slot in InputBatch.sampling

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    layout: BatchLayout
    requests: list[CachedRequestState]  # batch order
    sample_rows: torch.Tensor  # [S] packed rows whose logits are sampled
    rows_per_request: list[int]  # sampled rows of each request (0, 1 or k+1)
    spec: list[list[int]]  # per request: drafts being verified
    kv_tokens: int
    attn_pairs: int
    prompt_rows: list[tuple[CachedRequestState, int, int, int]] = field(default_factory=list)  # (req, row, rows, pos)


class InputBatch:
    def __init__(self, block_size: int, device: torch.device, vocab_size: int) -> None:
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        # Sampling parameters as tensors, converted once per request here and then updated in place with
        # the accepted tokens, so a step's sampling costs no more for a large logit_bias, stop list or history.
        self.sampling = SamplingState(vocab_size, device)

    def update(self, batch: ScheduledBatch) -> None:
        for rid in batch.finished_req_ids:
            self._remove(rid)
        for new in batch.new_requests:
            self._remove(new.req_id)  # resumed after a preemption: its state is rebuilt from its tokens
            gen = torch.Generator(self.device).manual_seed(new.seed) if new.seed is not None else None
            state = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                new.num_computed_tokens, new.params, gen, tuple(new.eos_token_ids), new.seed)
            state.sampling_slot = self.sampling.add(new.params, state.token_ids, new.num_prompt_tokens,
                                                    state.eos_token_ids)
            self.requests[new.req_id] = state
        grown: list[tuple[CachedRequestState, list[int]]] = []
        for c in batch.cached_requests:
            state = self.requests[c.req_id]
            state.token_ids.extend(c.new_token_ids)
            del state.block_ids[c.block_table_len - len(c.new_block_ids):]
            state.block_ids.extend(c.new_block_ids)
            state.num_computed_tokens = c.num_computed_tokens
            if c.new_token_ids:
                grown.append((state, c.new_token_ids))
        if grown:
            self.sampling.append([s.sampling_slot for s, _ in grown], [t for _, t in grown],
                                 [s.num_output_tokens for s, _ in grown])

    def reseed(self, inp: StepInputs) -> None:
        """Before the step's draws: each seeded request that samples starts from the generator state of the
        output position it samples (position_seed)."""
        for r, n in zip(inp.requests, inp.rows_per_request):
            if n and r.generator is not None:
                r.generator.manual_seed(position_seed(r.seed, r.num_output_tokens))

    def _remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.sampling.remove(state.sampling_slot)

    def sampling_metadata(self, inp: StepInputs) -> SamplingMetadata:
        """The step's sampling tensors, gathered from the requests' slots (see sample/state.py)."""
        reqs = inp.requests
        B = len(reqs)
        return self.sampling.metadata(
            np.fromiter((r.sampling_slot for r in reqs), np.int64, B),
            np.asarray(inp.rows_per_request, dtype=np.int64),
            np.fromiter((r.num_output_tokens for r in reqs), np.int64, B),
            inp.spec, [r.seed for r in reqs])

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Packed token ids and positions, the block table as one array, slots, and sampled rows. Built with
        numpy (a few µs per op on these small arrays, against torch's dispatch cost per op), handed over as
        tensors sharing the memory."""
        reqs = [self.requests[rid] for rid in batch.req_ids]
        lens = batch.num_scheduled_tokens
        B = len(reqs)
        spec = [batch.spec_token_ids.get(rid, []) for rid in batch.req_ids]
        ids = list(chain.from_iterable(
            r.token_ids[r.num_computed_tokens : r.num_computed_tokens + n - len(sp)] + sp
            for r, n, sp in zip(reqs, lens, spec)))
        q_len = np.asarray(lens, dtype=np.int64)
        start_pos = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, B)
        layout, positions = pack_layout(start_pos, q_len, [r.block_ids for r in reqs], self.block_size)
        q_start = layout.query_start.numpy()
        q_end = q_start + q_len
        kv_len = layout.kv_len.numpy()
        t = torch.from_numpy
        rows = np.asarray(batch.num_sample_rows, dtype=np.int64)
        sample_rows = np.repeat(q_end - rows, rows) + _ranks(rows)
        prompt_rows = []
        for i, r in enumerate(reqs):
            rng = batch.prompt_logprob_ranges.get(r.req_id)
            if rng is not None:
                prompt_rows.append((r, int(q_start[i]), rng[1], rng[0]))
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=t(positions).to(self.device),
            layout=layout,
            requests=reqs,
            sample_rows=t(sample_rows).to(self.device),
            rows_per_request=list(batch.num_sample_rows),
            spec=spec,
            # For the roofline: keys each new token attends to (causal pairs) and KV tokens read.
            kv_tokens=int(kv_len.sum()),
            attn_pairs=int((q_len * start_pos + q_len * (q_len + 1) // 2).sum()),
            prompt_rows=prompt_rows,
        )


def pack_layout(start_pos: np.ndarray, q_len: np.ndarray, tables: list[list[int]],
                block_size: int) -> tuple[BatchLayout, np.ndarray]:
    """The packed batch's attention layout (request i computes q_len[i] tokens from position start_pos[i]
    with block table tables[i]) and every token's position."""
    B, T = len(tables), int(q_len.sum())
    q_end = np.cumsum(q_len)
    q_start = q_end - q_len
    req_idx = np.repeat(np.arange(B), q_len)
    positions = np.arange(T) - q_start[req_idx] + start_pos[req_idx]
    table = block_table(tables)
    slots = table[req_idx, positions // block_size] * block_size + positions % block_size
    kv_len = start_pos + q_len
    t = torch.from_numpy
    layout = BatchLayout(query_start=t(q_start), query_len=t(q_len), kv_len=t(kv_len), block_table=t(table),
                         slot_mapping=t(slots), num_tokens=T, max_query_len=int(q_len.max()),
                         max_kv_len=int(kv_len.max()))
    return layout, positions


def block_table(rows: list[list[int]]) -> np.ndarray:
    """The requests' block ids as one [B, longest] array: one scatter of the concatenated rows."""
    B = len(rows)
    nblocks = np.fromiter((len(r) for r in rows), np.int64, B)
    table = np.zeros((B, int(nblocks.max())), dtype=np.int64)
    flat = np.fromiter(chain.from_iterable(rows), np.int64, int(nblocks.sum()))
    table[np.repeat(np.arange(B), nblocks), _ranks(nblocks)] = flat
    return table


def _run_starts(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum: where each run of `counts` starts."""
    return np.cumsum(counts) - counts


def _ranks(counts: np.ndarray) -> np.ndarray:
    """[0..c0-1, 0..c1-1, ...] for counts [c0, c1, ...]."""
    return np.arange(int(counts.sum())) - np.repeat(_run_starts(counts), counts)
