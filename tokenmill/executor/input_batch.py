"""The worker's copy of the running requests, updated from each ScheduledBatch, and the step's tensors.

The core sends a request in full once and then only diffs (core/batch.py); this file applies them and
turns the batch into the packed, unpadded tensors the model and the attention backend read.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import numpy as np
import torch

from tokenmill.core.batch import CachedRequestData, ScheduledBatch
from tokenmill.host_upload import Uploader
from tokenmill.layers.attention_backends.base import BatchLayout
from tokenmill.sample.draws import position_seed
from tokenmill.sample.sampler import SamplingMetadata
from tokenmill.sample.state import SamplingState
from tokenmill.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedRequestState:
    req_id: str
    # Accepted tokens (prompt + output) and the block table as lists too: the draft proposers and prompt
    # logprobs read them as sequences (spec_decode/draft.py); InputBatch's arrays hold the same values.
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    # Seeded requests: a generator for a draft model's draws, reseeded by output position before each step (the
    # sampler itself needs none: its seeded draws are counter-based, sample/draws.py).
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    lora: Any = None  # lora.request.LoRARequest of an adapter request
    sampling_slot: int = -1  # the request's slot in InputBatch.sampling
    row: int = -1  # the request's row of InputBatch's persistent arrays
    # An embedding request with mean pooling: the sum of its prompt's final hidden states over the chunks run so
    # far (float32, on the device) and how many positions it holds (executor/pooling.py).
    pool_sum: Any = None
    pool_count: int = 0

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
    group_layouts: list[BatchLayout] = field(default_factory=list)  # KV cache groups after the first: their tables
    # Per request: its drafts' tree (parents, spec_decode/tree.py), or None for a chain or no drafts.
    spec_parents: list[list[int] | None] = field(default_factory=list)


class InputBatch:
    """The held requests in persistent arrays, one row per request (reused once it finishes), written only
    where a step's diffs change them; a step's tensors are then gathered from them with a fixed number of
    numpy ops, whatever the batch size or the context lengths (no per-token Python, and per-request
    Python only to look requests up and extend their lists)."""

    def __init__(self, block_size: int, device: torch.device, vocab_size: int, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_groups = num_groups  # KV cache groups (executor/kv_groups.py): a block table each
        self.device = device
        self.uploader = Uploader(device)  # pinned, non-blocking copies on CUDA; none on the CPU
        self.requests: dict[str, CachedRequestState] = {}
        # Sampling parameters as tensors, converted once per request here and then updated in place with
        # the accepted tokens, so a step's sampling costs no more for a large logit_bias, stop list or history.
        self.sampling = SamplingState(vocab_size, device, self.uploader)
        # Per row; grown (doubled) on demand: rows with the number of requests held at once, token columns
        # with the longest sequence, block columns with the longest table. int32 like vLLM's: half the
        # memory of int64 for ids and blocks that fit.
        self.token_ids = np.zeros((0, 0), dtype=np.int32)  # [rows, cap] tokens known (past them: stale)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.num_computed = np.zeros(0, dtype=np.int64)  # tokens in the KV cache before the step
        self.block_table = np.zeros((num_groups, 0, 0), dtype=np.int32)  # [groups, rows, cap]; 0 past each row's blocks
        self.num_blocks = np.zeros(0, dtype=np.int64)
        self.free_rows: list[int] = []
        self.pooling: set[str] = set()  # held embedding requests (a step without any skips pooling at once)

    def update(self, batch: ScheduledBatch) -> None:
        for rid in batch.finished_req_ids:
            self._remove(rid)
        for new in batch.new_requests:
            if len(new.group_block_ids) != self.num_groups - 1:
                raise ValueError(f"request {new.req_id} has block tables for {len(new.group_block_ids) + 1} KV cache "
                                 f"group(s), this worker keeps {self.num_groups}")
            self._remove(new.req_id)  # resumed after a preemption: its state is rebuilt from its tokens
            gen = torch.Generator(self.device).manual_seed(new.seed) if new.seed is not None else None
            state = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                new.num_computed_tokens, new.params, gen, tuple(new.eos_token_ids), new.seed, new.lora)
            state.sampling_slot = self.sampling.add(new.params, state.token_ids, new.num_prompt_tokens,
                                                    state.eos_token_ids)
            self._add_row(state, new.group_block_ids)
            self.requests[new.req_id] = state
            if new.params.pooling is not None:
                self.pooling.add(new.req_id)
        if batch.cached_requests:
            self._apply_diffs(batch.cached_requests)

    def _add_row(self, state: CachedRequestState, group_block_ids: list[list[int]]) -> None:
        row = self._take_row()
        n, nb = len(state.token_ids), len(state.block_ids)
        self._reserve(n, nb)
        self.token_ids[row, :n] = np.fromiter(state.token_ids, np.int32, n)
        self.block_table[0, row, :nb] = state.block_ids
        for g, table in enumerate(group_block_ids, 1):
            self.block_table[g, row, :nb] = table
        self.num_tokens[row] = n
        self.num_blocks[row] = nb
        self.num_computed[row] = state.num_computed_tokens
        state.row = row

    def _apply_diffs(self, diffs: list[CachedRequestData]) -> None:
        """Held requests' accepted tokens, block table tails and computed counts: the lists per request
        (cheap appends), the arrays in one scatter per kind for the whole step."""
        states = [self.requests[c.req_id] for c in diffs]
        table_changed = False
        for s, c in zip(states, diffs):
            s.token_ids.extend(c.new_token_ids)
            keep = c.block_table_len - len(c.new_block_ids)  # the table's head the diff leaves as it was
            held = len(s.block_ids)
            if held > keep:  # rejected drafts' blocks were freed: cut the tail (zero what is not replaced)
                if held > c.block_table_len:
                    self.block_table[:, s.row, c.block_table_len : held] = 0
                del s.block_ids[keep:]
                table_changed = True
            if c.new_block_ids:
                s.block_ids.extend(c.new_block_ids)
                table_changed = True
            s.num_computed_tokens = c.num_computed_tokens
        K = len(diffs)
        rows = np.fromiter((s.row for s in states), np.int64, K)
        self.num_computed[rows] = np.fromiter((c.num_computed_tokens for c in diffs), np.int64, K)
        counts = [len(c.new_token_ids) for c in diffs]
        total = sum(counts)
        if total:
            lengths = np.fromiter((len(s.token_ids) for s in states), np.int64, K)  # this step's tokens included
            self._reserve(tokens=int(lengths.max()))
            tokens = np.fromiter(chain.from_iterable(c.new_token_ids for c in diffs), np.int32, total)
            if counts.count(1) == K:  # one token each (decodes): no ranks to compute
                self.token_ids[rows, lengths - 1] = tokens
            else:
                n = np.asarray(counts, dtype=np.int64)
                self.token_ids[np.repeat(rows, n), np.repeat(lengths - n, n) + _ranks(n)] = tokens
            self.num_tokens[rows] = lengths
            if self.sampling.tracks_tokens:  # usually not: then skip building the call's lists
                grown = [(s, c.new_token_ids) for s, c in zip(states, diffs) if c.new_token_ids]
                self.sampling.append([s.sampling_slot for s, _ in grown], [t for _, t in grown],
                                     [s.num_output_tokens for s, _ in grown])
        if table_changed:
            n = np.fromiter((len(c.new_block_ids) for c in diffs), np.int64, K)
            table_len = np.fromiter((len(s.block_ids) for s in states), np.int64, K)
            self._reserve(blocks=int(table_len.max()))
            at = (np.repeat(rows, n), np.repeat(table_len - n, n) + _ranks(n))
            total = int(n.sum())
            self.block_table[0][at] = np.fromiter(chain.from_iterable(c.new_block_ids for c in diffs), np.int32, total)
            for g in range(1, self.num_groups):
                self.block_table[g][at] = np.fromiter(
                    chain.from_iterable(c.group_new_block_ids[g - 1] for c in diffs), np.int32, total)
            self.num_blocks[rows] = table_len

    def reseed(self, inp: StepInputs) -> None:
        """Before the step's draws: each seeded request that samples starts from the generator state of the
        output position it samples (position_seed)."""
        for r, n in zip(inp.requests, inp.rows_per_request):
            if n and r.generator is not None:
                r.generator.manual_seed(position_seed(r.seed, r.num_output_tokens))

    def _remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.pooling.discard(req_id)
            self.sampling.remove(state.sampling_slot)
            row = state.row
            self.block_table[:, row, : self.num_blocks[row]] = 0  # the next request in this row pads with 0
            self.num_tokens[row] = self.num_blocks[row] = self.num_computed[row] = 0
            self.free_rows.append(row)

    def _take_row(self) -> int:
        if not self.free_rows:
            old = len(self.num_tokens)
            cap = max(16, 2 * old)
            self.token_ids = _resized(self.token_ids, (cap, self.token_ids.shape[1]))
            G, _, cols = self.block_table.shape
            self.block_table = _resized(self.block_table, (G, cap, cols))
            self.num_tokens, self.num_computed, self.num_blocks = (
                _resized(a, (cap,)) for a in (self.num_tokens, self.num_computed, self.num_blocks))
            self.free_rows.extend(range(cap - 1, old - 1, -1))  # popped lowest first
        return self.free_rows.pop()

    def _reserve(self, tokens: int = 0, blocks: int = 0) -> None:
        """Room for `tokens` tokens and `blocks` blocks in every row (doubling, so a growing request
        copies the arrays O(log length) times)."""
        rows, cap = self.token_ids.shape
        if tokens > cap:
            self.token_ids = _resized(self.token_ids, (rows, max(tokens, 2 * cap, 256)))
        G, rows, cap = self.block_table.shape
        if blocks > cap:
            self.block_table = _resized(self.block_table, (G, rows, max(blocks, 2 * cap, 16)))

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
        """Packed token ids and positions, the block table, slots and sampled rows, gathered from the rows of
        the batch's requests. Built with numpy (a µs or so per op on these small arrays, against torch's
        dispatch cost per op; Python sums and maxes on the short per-request lists cost less still) into
        fresh arrays (a step's inputs outlive the next prepare: pipeline micro-batches), handed over as tensors
        sharing the memory; the token ids, positions and sampled rows reach the device in one copy (host_upload:
        none on the CPU, from pinned memory without blocking on CUDA)."""
        reqs = [self.requests[rid] for rid in batch.req_ids]
        B = len(reqs)
        lens = batch.num_scheduled_tokens
        T, max_query_len = sum(lens), max(lens)
        rows = np.fromiter((r.row for r in reqs), np.int64, B)
        q_len = np.asarray(lens, dtype=np.int64)
        start_pos = self.num_computed[rows]
        kv_len = start_pos + q_len
        max_kv_len = int(kv_len.max())
        self._reserve(tokens=max_kv_len)  # drafts sit past the known tokens: gathered, then overwritten
        if max_query_len == 1:  # decodes only: token i is request i's
            q_start = np.arange(B)
            positions, tok_rows = start_pos, rows
        else:
            q_start = np.cumsum(q_len) - q_len
            positions = np.arange(T) + np.repeat(start_pos - q_start, q_len)
            tok_rows = np.repeat(rows, q_len)  # each token's row of the arrays
        q_end = q_start + q_len
        bs = self.block_size
        num_blocks = self.num_blocks[rows]
        if (kv_len > num_blocks * bs).any():  # a slot past the table would silently be block 0's
            i = int(np.argmax(kv_len > num_blocks * bs))
            raise IndexError(f"request {reqs[i].req_id} computes up to position {int(kv_len[i]) - 1} with "
                             f"{int(num_blocks[i])} blocks of {bs}")
        table = self.block_table[0, rows, : int(num_blocks.max())]
        # Gathers by flat index: np.take on a 1-D view costs less than 2-D fancy indexing.
        block, offset = np.divmod(positions, bs)
        flat = tok_rows * self.block_table.shape[2] + block
        slots = np.take(self.block_table[0].reshape(-1), flat).astype(np.int64) * bs + offset
        num_rows = batch.num_sample_rows
        S = sum(num_rows)
        if S == B and max(num_rows) == 1:  # the usual: each request samples its last row
            sample_rows = q_end - 1
        else:
            counts = np.asarray(num_rows, dtype=np.int64)
            sample_rows = np.repeat(q_end - counts, counts) + _ranks(counts)
        # Token ids, positions and sampled rows in one host buffer: one copy to the device, three views.
        host = np.empty(2 * T + S, dtype=np.int64)
        host[:T] = np.take(self.token_ids.reshape(-1), tok_rows * self.token_ids.shape[1] + positions)
        spec = [batch.spec_token_ids.get(rid, []) for rid in batch.req_ids]
        if batch.spec_token_ids:  # the drafts: the last k tokens of their request's chunk
            k = np.fromiter(map(len, spec), np.int64, B)
            host[np.repeat(q_end - k, k) + _ranks(k)] = np.fromiter(chain.from_iterable(spec), np.int64,
                                                                    int(k.sum()))
        parents = [batch.spec_parents.get(rid) for rid in batch.req_ids] if batch.spec_parents else []
        tree_req = tree_mask = None
        if parents:  # draft trees: nodes at their path's positions, each seeing its ancestors only
            tree_req, tree_mask, positions = _trees(parents, q_end, start_pos, positions)
        host[T : 2 * T] = positions
        host[2 * T :] = sample_rows
        dev = self.uploader.upload(host)
        t = torch.from_numpy
        layout = BatchLayout(query_start=t(q_start), query_len=t(q_len), kv_len=t(kv_len), block_table=t(table),
                             slot_mapping=t(slots), num_tokens=T, max_query_len=max_query_len,
                             max_kv_len=max_kv_len, tree_req=tree_req, tree_mask=tree_mask)
        # The other KV cache groups: same queries and lengths, their own tables and slots.
        group_layouts = [replace(layout, block_table=t(self.block_table[g, rows, : int(num_blocks.max())]),
                                 slot_mapping=t(np.take(self.block_table[g].reshape(-1), flat).astype(np.int64) * bs
                                                + offset))
                         for g in range(1, self.num_groups)]
        prompt_rows = []
        if batch.prompt_logprob_ranges:
            for i, r in enumerate(reqs):
                rng = batch.prompt_logprob_ranges.get(r.req_id)
                if rng is not None:
                    prompt_rows.append((r, int(q_start[i]), rng[1], rng[0]))
        return StepInputs(
            input_ids=dev[:T],
            positions=dev[T : 2 * T],
            layout=layout,
            requests=reqs,
            sample_rows=dev[2 * T :],
            rows_per_request=list(num_rows),
            spec=spec,
            # For the roofline: KV tokens read, and the keys each new token attends to (position + 1).
            kv_tokens=int(kv_len.sum()),
            attn_pairs=int(positions.sum()) + T,
            prompt_rows=prompt_rows,
            group_layouts=group_layouts,
            spec_parents=parents,
        )


def _trees(parents: list[list[int] | None], q_end: np.ndarray, start_pos: np.ndarray,
           positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """The requests verifying trees: their batch indices, visibility masks [R, Nq, Nq] (padded), and the step's
    positions with each node at its root's position + its depth (its slot stays the node's index)."""
    from tokenmill.spec_decode.tree import depths, visibility

    which = [i for i, p in enumerate(parents) if p is not None]
    nq = max(len(parents[i]) for i in which) + 1
    mask = np.zeros((len(which), nq, nq), dtype=bool)
    positions = positions.copy()
    for r, i in enumerate(which):  # per tree request: its visibility and its nodes' positions
        p = parents[i]
        n = len(p)
        mask[r, : n + 1, : n + 1] = visibility(p)
        positions[q_end[i] - n: q_end[i]] = start_pos[i] + depths(p)
    return torch.tensor(which, dtype=torch.long), torch.from_numpy(mask), positions


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


def _resized(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A zero array of `shape` with `a` copied into its leading corner."""
    out = np.zeros(shape, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out
