"""Runs one ScheduledBatch: tensors -> one forward pass over the packed batch -> logits -> sampled tokens.

The runner never sees the scheduler's objects: it keeps its own request states (input_batch.py),
updated from the batch's diffs, and returns a picklable ModelRunnerOutput.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from tokenmill.core.batch import ModelRunnerOutput, PromptLogprobs, ScheduledBatch, StepTimings
from tokenmill.executor.input_batch import InputBatch, StepInputs
from tokenmill.layers.attention import Attention, AttentionTimer
from tokenmill.layers.attention_backends import kv_quant
from tokenmill.layers.attention_backends.base import AttentionBackend
from tokenmill.sample.sampler import Sampler, SamplingMetadata, compute_logprobs

log = logging.getLogger(__name__)

# Time the attention backend per step: on CPU by default (two perf_counter calls per layer); elsewhere
# only with TOKENMILL_TIME_ATTENTION=1, since on CUDA each timed call must synchronise the device. 0: never.
TIME_ATTENTION_ENV = "TOKENMILL_TIME_ATTENTION"


def _attention_timer(device: torch.device) -> AttentionTimer | None:
    flag = os.environ.get(TIME_ATTENTION_ENV, "").strip()
    if flag == "0" or (not flag and device.type != "cpu"):
        return None
    if device.type not in ("cpu", "cuda"):
        return None  # no device synchronisation to time its kernels with
    return AttentionTimer(sync=device.type == "cuda")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, vocab_size: int, block_size: int, device: torch.device,
                 backend: AttentionBackend) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.input_batch = InputBatch(block_size, device)
        self.sampler = Sampler()
        self.num_blocks = 0
        self.kv_dtype: torch.dtype | None = None
        self.attn_timer = _attention_timer(torch.device(device))
        for a in self.attn_layers:
            a.timer = self.attn_timer
        # For the K/V bytes attention reads per step: (sliding window or None, K+V bytes per token summed
        # over the layers with that window), set once the cache dtype is known.
        self._attn_read_groups: list[tuple[int | None, int]] = []

    def block_bytes(self, kv_dtype: torch.dtype) -> int:
        """K and V of one block over all layers (with int8's scales)."""
        return sum(kv_quant.block_bytes(self.block_size, a.num_kv_heads, a.head_dim, kv_dtype) for a in self.attn_layers)

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes(self.kv_dtype)

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        self.backend.allocate_kv_cache(self.attn_layers, num_blocks, kv_dtype)
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype
        groups: dict[int | None, int] = {}
        for a in self.attn_layers:
            per_token = kv_quant.block_bytes(1, a.num_kv_heads, a.head_dim, kv_dtype)
            groups[a.sliding_window] = groups.get(a.sliding_window, 0) + per_token
        self._attn_read_groups = list(groups.items())

    def attn_read_bytes(self, query_len: torch.Tensor, kv_len: torch.Tensor) -> int:
        """K/V bytes this step's attention must read: per layer, every request's attended cache tokens x
        num_kv_heads x head_dim x 2 (K and V) x itemsize. With a sliding window W a query at position p
        sees keys p-W+1..p, so a request's chunk of n new queries ending at kv_len reads
        min(kv_len, n + W - 1) tokens (min(kv_len, W) when decoding)."""
        total = 0
        for window, per_token in self._attn_read_groups:
            read = kv_len if window is None else torch.minimum(kv_len, query_len + (window - 1))
            total += int(read.sum()) * per_token
        return total

    def kv_caches(self) -> list[torch.Tensor]:
        """Every layer's K and V pool (and int8's scales), each indexed by block on its first dimension."""
        return [t for a in self.attn_layers for t in kv_quant.layer_caches(a)]

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self.input_batch.update(batch)
        if not batch:
            return ModelRunnerOutput()
        inp = self.input_batch.prepare(batch)
        meta = self.backend.build_metadata(inp.layout)
        timer = self.attn_timer
        if timer is not None:
            timer.total = 0.0
        t1 = time.perf_counter()
        hidden = self.model(inp.input_ids, inp.positions, meta)
        logits = self.model.compute_logits(hidden[inp.sample_rows]) if inp.sample_rows.numel() else None
        prompt_lps = self._prompt_logprobs(hidden, inp)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        out = self._sample(logits, inp, batch) if logits is not None else ModelRunnerOutput()
        out.prompt_logprobs = prompt_lps
        layout = inp.layout
        out.timings = StepTimings(
            prepare_s=t1 - t0, forward_s=t2 - t1, sample_s=time.perf_counter() - t2, kv_tokens=inp.kv_tokens,
            attn_pairs=inp.attn_pairs, attn_s=timer.total if timer is not None else 0.0,
            attn_bytes=self.attn_read_bytes(layout.query_len, layout.kv_len))
        return out

    def _sample(self, logits: torch.Tensor, inp: StepInputs, batch: ScheduledBatch) -> ModelRunnerOutput:
        params, prompts, outputs, gens, banned = [], [], [], [], []
        grammar_rows, bitmask_rows = [], []  # sampled rows under a grammar, and their rows of the bitmask
        for r, rows, spec in zip(inp.requests, inp.rows_per_request, inp.spec):
            out_ids = r.token_ids[r.num_prompt_tokens:]
            ban = r.banned_tokens()
            first = batch.structured_output_rows.get(r.req_id)
            if first is not None and rows:
                grammar_rows.extend(range(len(params), len(params) + rows))
                bitmask_rows.extend(range(first, first + rows))
            for j in range(rows):
                params.append(r.params)
                prompts.append(r.prompt_token_ids)
                outputs.append(out_ids + spec[:j] if j else out_ids)
                gens.append(r.generator)
                banned.append(ban)
        meta = SamplingMetadata.build(params, prompts, outputs, gens, banned, self.vocab_size, self.device)
        if grammar_rows:
            bitmask = torch.from_numpy(batch.grammar_bitmask)
            meta.grammar_rows = torch.tensor(grammar_rows, dtype=torch.long, device=self.device)
            meta.grammar_bitmask = bitmask[torch.tensor(bitmask_rows, dtype=torch.long)].to(self.device)
        sampled = self.sampler(logits, meta)
        tokens = sampled.token_ids.tolist()
        lp = None
        if sampled.logprobs is not None:
            lp = (sampled.logprobs.tolist(), sampled.ranks.tolist(), sampled.top_ids.tolist(),
                  sampled.top_logprobs.tolist())
        result = ModelRunnerOutput()
        row = 0
        for r, rows, spec in zip(inp.requests, inp.rows_per_request, inp.spec):
            if not rows:
                continue
            got = tokens[row : row + rows]
            if spec:
                # Greedy verification: keep drafts while they equal what the model samples at their
                # position, then the model's own token. For a single proposed token per position
                # (q a point mass) this is exactly rejection sampling: accept with p(d), else draw
                # from p without d.
                accepted = 0
                while accepted < len(spec) and got[accepted] == spec[accepted]:
                    accepted += 1
                got = got[: accepted + 1]
            result.req_ids.append(r.req_id)
            result.sampled_token_ids.append(got)
            if lp is not None and r.params.logprobs is not None:
                k = r.params.logprobs
                result.logprobs[r.req_id] = [
                    (lp[0][i], lp[1][i], lp[2][i][:k], lp[3][i][:k]) for i in range(row, row + len(got))]
            row += rows
        return result

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: StepInputs) -> dict[str, PromptLogprobs]:
        out = {}
        for r, row, rows, first_pos in inp.prompt_rows:
            logits = self.model.compute_logits(hidden[row : row + rows])
            k = r.params.prompt_logprobs
            targets = r.token_ids[first_pos + 1 : first_pos + 1 + rows]
            lp, top_lp, top_ids, ranks = compute_logprobs(logits, torch.tensor(targets, device=logits.device), max(k, 1))
            out[r.req_id] = PromptLogprobs(first_pos, targets, lp.tolist(), ranks.tolist(),
                                           top_ids[:, :k].tolist(), top_lp[:, :k].tolist())
        return out
