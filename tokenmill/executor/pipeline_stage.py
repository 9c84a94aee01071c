"""The model runner's pipeline-parallel step: this stage's layers over the step in two micro-batches, so the
stages overlap; the last stage samples. Mixed into ModelRunner."""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from tokenmill.core.batch import ModelRunnerOutput, ScheduledBatch, StepTimings
from tokenmill.executor.input_batch import InputBatch, StepInputs
from tokenmill.layers import collectives
from tokenmill.layers.attention import AttentionTimer


class PipelineStage:
    """Mixed into ModelRunner; uses its input batch, metadata, sampling and prompt logprobs."""

    model: torch.nn.Module
    device: torch.device
    input_batch: InputBatch
    lora: object | None
    attn_timer: AttentionTimer | None

    def _execute_stage(self, batch: ScheduledBatch, t0: float) -> ModelRunnerOutput:
        """This stage's layers over the step in two micro-batches (contiguous halves of the requests by
        tokens): stage s sends micro-batch 1 on and computes micro-batch 2 while stage s+1 computes 1, so
        the stages overlap. The last stage samples both at once; the others return an empty output."""
        import torch.distributed as dist

        m = self.model
        tp = dist.get_world_size() // m.pp_size
        rank = dist.get_rank()
        H, dtype = m.spec.hidden_size, m.compute_dtype
        pending, hidden, inputs = [], [], []
        prepare_s = 0.0
        timer = self.attn_timer
        if timer is not None:
            timer.total = 0.0
        t1 = time.perf_counter()
        for mb in micro_batches(batch, 2):
            tp0 = time.perf_counter()
            inp = self.input_batch.prepare(mb)
            if self.lora is not None:
                self.lora.prepare(inp.requests, mb.num_scheduled_tokens)
            meta = self._metadata(inp)
            prepare_s += time.perf_counter() - tp0
            carried = None
            if not m.is_first:
                T = inp.input_ids.numel()
                carried = tuple(collectives.recv_stage([(T, H), (T, H)], dtype, rank - tp, self.device))
            out = m(inp.input_ids, inp.positions, meta, carried)
            if m.is_last:
                hidden.append(out)
                inputs.append(inp)
            else:
                pending += collectives.send_stage(list(out), rank + tp)
        for work in pending:
            work.wait()
        result = ModelRunnerOutput()
        if m.is_last:
            rows = [m.compute_logits(h[inp.sample_rows]) for h, inp in zip(hidden, inputs) if inp.sample_rows.numel()]
            t2 = time.perf_counter()
            whole = merge_inputs(inputs)
            if rows:
                logits = torch.cat(rows)
                result = self._sample(logits, whole, batch)
            for h, inp in zip(hidden, inputs):
                result.prompt_logprobs.update(self._prompt_logprobs(h, inp))
                result.pooled.update(self._pool(h, inp))
        else:
            t2 = time.perf_counter()
        lay = [inp.layout for inp in inputs]
        result.timings = StepTimings(
            prepare_s=(t1 - t0) + prepare_s, forward_s=t2 - t1 - prepare_s, sample_s=time.perf_counter() - t2,
            kv_tokens=sum(i.kv_tokens for i in inputs), attn_pairs=sum(i.attn_pairs for i in inputs),
            attn_s=timer.total if timer is not None else 0.0,
            attn_bytes=sum(self.attn_read_bytes(x.query_len, x.kv_len) for x in lay),
            collective_s=collectives.take_time(), weight_wait_s=self._weight_wait())
        return result


def micro_batches(batch: ScheduledBatch, parts: int) -> list[ScheduledBatch]:
    """Split a step into `parts` contiguous groups of requests with about equal tokens (fewer when there
    are fewer requests). Each keeps its requests' drafts, sampled rows and prompt-logprob ranges."""
    n = len(batch.req_ids)
    if parts <= 1 or n < 2:
        return [batch]
    total, acc, cut = batch.num_tokens, 0, n - 1
    for i, t in enumerate(batch.num_scheduled_tokens[:-1]):
        acc += t
        if acc * parts >= total:
            cut = i + 1
            break

    def sub(a: int, b: int) -> ScheduledBatch:
        ids = batch.req_ids[a:b]
        keep = set(ids)
        return ScheduledBatch(
            req_ids=ids, num_scheduled_tokens=batch.num_scheduled_tokens[a:b], num_sample_rows=batch.num_sample_rows[a:b],
            spec_token_ids={r: v for r, v in batch.spec_token_ids.items() if r in keep},
            spec_parents={r: v for r, v in batch.spec_parents.items() if r in keep},
            prompt_logprob_ranges={r: v for r, v in batch.prompt_logprob_ranges.items() if r in keep})

    return [sub(0, cut), sub(cut, n)]


def merge_inputs(inputs: list[StepInputs]) -> StepInputs:
    """The micro-batches' requests and sampled rows in batch order, for one sampling pass."""
    if len(inputs) == 1:
        return inputs[0]
    return replace(inputs[0], requests=[r for i in inputs for r in i.requests],
                   rows_per_request=[n for i in inputs for n in i.rows_per_request],
                   spec=[s for i in inputs for s in i.spec])
