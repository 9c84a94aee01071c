"""Per-request sampling state, converted to tensors once when the worker admits a request and kept up to
date with the tokens each step accepts, so that a step's sampling tensors are gathered by index at a cost
that does not grow with the size of a request's logit_bias, stop list or history.

Held by the persistent input batch (executor/input_batch.py). Each request gets a slot: a row of a small
table of its scalar parameters and, only when it needs them, a row of each vocabulary-wide table:

  logit_bias      [V] float32  the additive bias
  min_tokens ban  [V] bool     stop ids and EOS; released once min_tokens output tokens exist
  prompt mask     [V] bool     the prompt's tokens, for the repetition penalty
  output counts   [V] float32  each output token's count, for every penalty; +1 per accepted token

Row 0 of each vocabulary table is all zero and stands for every request without one, so a step needs one
index_select per kind in use to get its [rows, V] tensor, and apply_penalties (sampler.py) reads those
exactly as it reads the tensors SamplingMetadata.build makes from lists (the reference path, kept for tests).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from tokenmill.host_upload import Uploader
from tokenmill.sample.draws import UNSEEDED, position_seeds
from tokenmill.sample.sampler import SamplingMetadata
from tokenmill.sampling_params import SamplingParams

# Columns of the scalar table. All float32: top_k is clamped to V at admission (a larger k keeps every
# token, as does V itself), and V < 2**24 is exact in float32.
_TEMPERATURE, _TOP_K, _TOP_P, _MIN_P, _REPETITION, _PRESENCE, _FREQUENCY = range(7)
_NUM_SCALARS = 7
# Columns of the per-slot table of vocabulary rows.
_BIAS, _BAN, _PROMPT, _COUNTS = range(4)


class VocabRows:
    """A [capacity, V] table handed out a row at a time. Row 0 stays zero. Allocated on first use,
    doubled when full, and dropped when no request holds a row, so a burst of requests with (say) a
    logit_bias does not keep its memory afterwards."""

    def __init__(self, vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.device = device
        self.table: Tensor | None = None
        self.free: list[int] = []
        self.used = 0

    def alloc(self) -> int:
        if not self.free:
            self._grow()
        self.used += 1
        return self.free.pop()

    def release(self, row: int) -> None:
        if row == 0:
            return
        self.used -= 1
        if self.used == 0:
            self.table, self.free = None, []
            return
        self.table[row].zero_()  # row 0 must stay zero, and a reused row must start from zero
        self.free.append(row)

    def gather(self, rows: Tensor) -> Tensor:
        return self.table.index_select(0, rows)

    def _grow(self) -> None:
        old = 0 if self.table is None else self.table.shape[0]
        cap = max(8, 2 * old)
        table = torch.zeros(cap, self.vocab_size, dtype=self.dtype, device=self.device)
        if self.table is not None:
            table[:old] = self.table
        self.table = table
        self.free.extend(range(cap - 1, max(old, 1) - 1, -1))  # popped lowest first; never row 0


class SamplingState:
    """Every admitted request's sampling parameters as tensors, indexed by slot."""

    def __init__(self, vocab_size: int, device: torch.device | str, uploader: Uploader | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # pinned, non-blocking copies on CUDA, none on the CPU (the input batch's, shared)
        self.uploader = uploader if uploader is not None else Uploader(self.device)
        self.scalars = np.zeros((0, _NUM_SCALARS), dtype=np.float32)
        self.vocab_rows = np.zeros((0, 4), dtype=np.int64)  # slot -> its row of each vocabulary table (0: none)
        self.min_tokens = np.zeros(0, dtype=np.int64)
        self.logprobs = np.zeros(0, dtype=np.int64)  # -1: no logprobs
        self.free_slots: list[int] = []
        V, dev = vocab_size, self.device
        self.bias = VocabRows(V, torch.float32, dev)
        self.ban = VocabRows(V, torch.bool, dev)
        self.prompt = VocabRows(V, torch.bool, dev)
        self.counts = VocabRows(V, torch.float32, dev)
        self._tables = (self.bias, self.ban, self.prompt, self.counts)  # in _BIAS.._COUNTS order
        # The last step's metadata where it depended on nothing but which slots sample how many rows (no seeds, no
        # vocabulary-wide table): decode steps of an unchanged batch ask for the same again. `_version` moves
        # whenever a slot's parameters do (add, remove).
        self._version = 0
        self._last: tuple[tuple, SamplingMetadata] | None = None

    # ---- admission and release --------------------------------------------------------------
    def add(self, params: SamplingParams, token_ids: Sequence[int], num_prompt_tokens: int,
            eos_token_ids: Sequence[int]) -> int:
        """Convert a request's parameters once, at admission (or re-admission after a preemption, when
        `token_ids` holds the output so far and its counts are rebuilt from it). Returns its slot."""
        slot = self._take_slot()
        self._version += 1
        p, V = params, self.vocab_size
        self.scalars[slot] = (0.0 if p.greedy else p.temperature, min(max(p.top_k, 0), V), p.top_p, p.min_p,
                              p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        self.min_tokens[slot] = p.min_tokens
        self.logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        rows = self.vocab_rows[slot]
        rows[:] = 0
        if p.logit_bias:
            ids = _ids(p.logit_bias.keys(), len(p.logit_bias))
            values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
            keep = _in_vocab(ids, V)
            rows[_BIAS] = self._fill(self.bias, ids[keep], values[keep])
        num_output = len(token_ids) - num_prompt_tokens
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        if num_output < p.min_tokens and banned:
            ids = _ids(banned, len(banned))
            rows[_BAN] = self._fill(self.ban, ids[_in_vocab(ids, V)])
        if p.repetition_penalty != 1.0:
            ids = _ids(token_ids[:num_prompt_tokens], num_prompt_tokens)
            rows[_PROMPT] = self._fill(self.prompt, ids[_in_vocab(ids, V)])
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            ids = _ids(token_ids[num_prompt_tokens:], num_output)
            ids = ids[_in_vocab(ids, V)]
            rows[_COUNTS] = self._fill(self.counts, ids, torch.ones(len(ids)))
        return slot

    def remove(self, slot: int) -> None:
        self._version += 1
        for table, row in zip(self._tables, self.vocab_rows[slot].tolist()):
            table.release(row)
        self.vocab_rows[slot] = 0
        self.free_slots.append(slot)

    @property
    def tracks_tokens(self) -> bool:
        """Some request keeps output-token counts or a min_tokens ban: `append` has work to do."""
        return bool(self.counts.used or self.ban.used)

    def append(self, slots: Sequence[int], new_token_ids: Sequence[Sequence[int]],
               num_output_tokens: Sequence[int]) -> None:
        """Requests `slots` accepted `new_token_ids` and now have `num_output_tokens` output tokens: add
        the tokens to their counts (one scatter over the whole step) and drop min_tokens bans now met."""
        slots = np.asarray(slots, dtype=np.int64)
        count_rows = self.vocab_rows[slots, _COUNTS]
        if count_rows.any():
            n = np.fromiter((len(t) for t in new_token_ids), np.int64, len(slots))
            rows = np.repeat(count_rows, n)
            tokens = np.fromiter(chain.from_iterable(new_token_ids), np.int64, int(n.sum()))
            keep = (rows != 0) & (tokens >= 0) & (tokens < self.vocab_size)
            self._count(self.counts.table, rows[keep], tokens[keep])
        ban_rows = self.vocab_rows[slots, _BAN]
        met = (ban_rows != 0) & (np.asarray(num_output_tokens, dtype=np.int64) >= self.min_tokens[slots])
        for slot, row in zip(slots[met].tolist(), ban_rows[met].tolist()):
            self.ban.release(row)
            self.vocab_rows[slot, _BAN] = 0

    # ---- one step ------------------------------------------------------------------------------
    def metadata(self, slots: np.ndarray, rows: np.ndarray, num_output_tokens: np.ndarray,
                 drafts: Sequence[Sequence[int]], seeds: Sequence[int | None]) -> SamplingMetadata:
        """The step's SamplingMetadata. Request i (slot slots[i], num_output_tokens[i] tokens of output)
        owns rows[i] consecutive sampled rows: row j scores output token number num_output_tokens[i] + j,
        after the drafts drafts[i][:j], which its penalties count as output and which decide whether
        min_tokens still bans stop tokens and EOS there. A seeded request (seeds[i] not None) keys each row's
        draws by that output position (draws.position_seeds).

        A step like the last one (same slots and rows, parameters unchanged, no seeds, no vocabulary-wide table)
        gets the last metadata again, as a new object (the caller attaches its grammar rows to it): building it
        took ~0.15 ms of a 135M batch-1 token (docs/performance.md)."""
        plain = all(s is None for s in seeds) and not any(table.used for table in self._tables)
        key = (self._version, np.asarray(slots, np.int64).tobytes(), np.asarray(rows, np.int64).tobytes()) if plain else None
        if key is not None and self._last is not None and self._last[0] == key:
            return dataclasses.replace(self._last[1])
        meta = self._build_metadata(slots, rows, num_output_tokens, drafts, seeds)
        self._last = (key, dataclasses.replace(meta)) if key is not None else None
        return meta

    def _build_metadata(self, slots: np.ndarray, rows: np.ndarray, num_output_tokens: np.ndarray,
                        drafts: Sequence[Sequence[int]], seeds: Sequence[int | None]) -> SamplingMetadata:
        row_slot = np.repeat(slots, rows)
        sc = self.scalars[row_slot]
        # One host-to-device copy for every scalar; its rows are then views.
        scalars = self.uploader.upload(sc.T)
        random = sc[:, _TEMPERATURE] > 0
        top_k, any_random = sc[:, _TOP_K], bool(random.any())
        logprobs = self.logprobs[row_slot]
        vocab = self._vocab_tensors(row_slot, rows, num_output_tokens, drafts)
        return SamplingMetadata(
            temperature=scalars[_TEMPERATURE],
            top_k=scalars[_TOP_K].long(),
            top_p=scalars[_TOP_P],
            min_p=scalars[_MIN_P],
            repetition_penalty=scalars[_REPETITION],
            presence_penalty=scalars[_PRESENCE],
            frequency_penalty=scalars[_FREQUENCY],
            prompt_mask=vocab[_PROMPT],
            output_counts=vocab[_COUNTS],
            logit_bias=vocab[_BIAS],
            banned=vocab[_BAN],
            seeds=self._row_seeds(seeds, rows, num_output_tokens),
            all_greedy=not any_random,
            all_seeded=all(s is not None for s, n in zip(seeds, rows) if n),
            max_num_logprobs=int(logprobs.max(initial=0)),
            need_logprobs=bool((logprobs >= 0).any()),
            use_top_k=any_random and bool((random & (top_k > 0) & (top_k < self.vocab_size)).any()),
            use_top_p=any_random and bool((random & (sc[:, _TOP_P] < 1.0)).any()),
            use_min_p=any_random and bool((random & (sc[:, _MIN_P] > 0.0)).any()),
        )

    def _row_seeds(self, seeds: Sequence[int | None], rows: np.ndarray, num_output_tokens: np.ndarray) -> Tensor | None:
        if all(s is None for s in seeds):
            return None
        seeded = np.fromiter((s is not None for s in seeds), bool, len(seeds))
        base = np.fromiter((s or 0 for s in seeds), np.uint64, len(seeds))
        keys = position_seeds(np.repeat(base, rows), np.repeat(num_output_tokens, rows) + _ranks(rows))
        keys = np.where(np.repeat(seeded, rows), keys, UNSEEDED)
        return self.uploader.upload(keys)

    def _vocab_tensors(self, row_slot: np.ndarray, rows: np.ndarray, num_output_tokens: np.ndarray,
                       drafts: Sequence[Sequence[int]]) -> list[Tensor | None]:
        """Per kind (_BIAS.._COUNTS order): the step's [rows, V] tensor, or None where no row has one."""
        if not any(table.used for table in self._tables):  # the usual case: nothing vocabulary-wide
            return [None] * len(self._tables)
        vocab_rows = self.vocab_rows[row_slot]
        if self.ban.used:  # ban only the rows that score an output position before min_tokens
            position = np.repeat(num_output_tokens, rows) + _ranks(rows)
            vocab_rows[:, _BAN] = np.where(position < self.min_tokens[row_slot], vocab_rows[:, _BAN], 0)
        in_use = vocab_rows.any(axis=0).tolist()
        index = self.uploader.upload(vocab_rows.T)  # one copy; rows are views
        out = [table.gather(index[kind]) if used else None
               for kind, (table, used) in enumerate(zip(self._tables, in_use))]
        if out[_COUNTS] is not None:
            self._count_drafts(out[_COUNTS], vocab_rows[:, _COUNTS], rows, drafts)
        return out

    def _count_drafts(self, counts: Tensor, count_rows: np.ndarray, rows: np.ndarray,
                      drafts: Sequence[Sequence[int]]) -> None:
        """Row j of a request verifying drafts d_0..d_{k-1} counts d_0..d_{j-1} as output: draft i adds
        one to rows i+1..k of its request (only where the request keeps counts)."""
        k = np.fromiter((len(d) for d in drafts), np.int64, len(drafts))
        if not k.any():
            return
        req = np.repeat(np.arange(len(k)), k)
        i = _ranks(k)
        tokens = np.fromiter(chain.from_iterable(drafts), np.int64, int(k.sum()))
        first_row = (np.cumsum(rows) - rows)[req] + i + 1  # of the rows this draft counts in
        reach = k[req] - i
        keep = (count_rows[first_row] != 0) & (tokens >= 0) & (tokens < self.vocab_size)
        first_row, reach, tokens = first_row[keep], reach[keep], tokens[keep]
        self._count(counts, np.repeat(first_row, reach) + _ranks(reach), np.repeat(tokens, reach))

    # ---- helpers -----------------------------------------------------------------------------
    def _fill(self, table: VocabRows, ids: Tensor, values: Tensor | None = None) -> int:
        """A fresh row of `table` with `ids` set (bool) or `values` summed at `ids` (float)."""
        row = table.alloc()
        dest = table.table[row]
        ids = ids.to(self.device)
        if values is None:
            dest[ids] = True
        else:
            dest.index_put_((ids,), values.to(dest.dtype).to(self.device), accumulate=True)
        return row

    def _count(self, table: Tensor, rows: np.ndarray, tokens: np.ndarray) -> None:
        """table[rows[n], tokens[n]] += 1 for every n, repeats included, in one scatter."""
        if not len(rows):
            return
        r = torch.from_numpy(rows).to(self.device)
        t = torch.from_numpy(tokens).to(self.device)
        table.index_put_((r, t), torch.ones(len(rows), dtype=table.dtype, device=self.device), accumulate=True)

    def _take_slot(self) -> int:
        if not self.free_slots:
            old = len(self.min_tokens)
            cap = max(16, 2 * old)
            self.scalars = _pad(self.scalars, cap)
            self.vocab_rows = _pad(self.vocab_rows, cap)
            self.min_tokens = _pad(self.min_tokens, cap)
            self.logprobs = _pad(self.logprobs, cap)
            self.free_slots.extend(range(cap - 1, old - 1, -1))
        return self.free_slots.pop()


def _ids(values, n: int) -> Tensor:
    """Token ids as an int64 tensor; ids beyond int64 are out of any vocabulary and dropped as -1."""
    try:
        return torch.from_numpy(np.fromiter(values, np.int64, n))
    except OverflowError:  # admission validates ids; this only keeps a stray huge one from failing the step
        return torch.tensor([t if -(2**63) <= t < 2**63 else -1 for t in values], dtype=torch.int64)


def _in_vocab(ids: Tensor, vocab_size: int) -> Tensor:
    return (ids >= 0) & (ids < vocab_size)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """[0..c0-1, 0..c1-1, ...] for counts [c0, c1, ...]."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _pad(a: np.ndarray, n: int) -> np.ndarray:
    """`a` with zero rows appended up to n rows."""
    return np.concatenate([a, np.zeros((n - len(a), *a.shape[1:]), a.dtype)])
