"""Runs one ScheduledBatch: tensors -> one forward pass over the packed batch -> logits -> sampled tokens.

The runner never sees the scheduler's objects: it keeps its own request states (input_batch.py),
updated from the batch's diffs, and returns a picklable ModelRunnerOutput.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from tokenmill.core.batch import ModelRunnerOutput, PromptLogprobs, ScheduledBatch, StepTimings
from tokenmill.executor.cuda_graphs import DecodeGraphs, capture_sizes
from tokenmill.executor.forward_clock import ForwardClock
from tokenmill.executor.input_batch import InputBatch, StepInputs
from tokenmill.executor.kv_groups import KVGroup, OffReasons, describe, plan_kv_groups, share_kv_cache
from tokenmill.layers import collectives
from tokenmill.layers.attention import Attention, AttentionTimer
from tokenmill.layers.attention_backends import kv_quant
from tokenmill.layers.attention_backends.base import AttentionBackend, GroupedMetadata
from tokenmill.sample.rejection_sampler import rejection_sample
from tokenmill.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, compute_logprobs, target_distribution
from tokenmill.sample.tree_sampler import TreeDraft, verify_on_device
from tokenmill.spec_decode.tree import chain
from tokenmill.testing import faults

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
                 backend: AttentionBackend, spec=None) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        # Every layer's window in the whole model (a pipeline stage holds only some of the layers).
        decoder = getattr(model, "spec", None)  # DecoderForCausalLM has one
        self.model_windows = ({layer.sliding_window for layer in decoder.layers} if decoder is not None
                              else {a.sliding_window for a in self.attn_layers})
        self.input_batch = InputBatch(block_size, device, vocab_size)
        self.kv_groups = [KVGroup(None, list(self.attn_layers))]  # configure_kv_groups
        self.sampler = Sampler()
        self.spec = spec  # spec_decode.decoder.SpecDecoder: proposes each request's next drafts
        self.lora = None  # lora.manager.LoRAManager with --enable-lora: adapter slots, set per step
        self._path_rows = None  # this step's accepted tree paths moved into chain order (packed rows: src, dst)
        # Prefill context parallelism (layers/attention_backends/context_parallel.py): this rank runs the model on
        # its share of the step's tokens; the final hidden states are gathered back. None: every token here.
        self.token_split = None
        self.num_blocks = 0
        self.kv_dtype: torch.dtype | None = None
        self.attn_timer = _attention_timer(torch.device(device))
        for a in self.attn_layers:
            a.timer = self.attn_timer
        # For the K/V bytes attention reads per step: (sliding window or None, K+V bytes per token summed
        # over the layers with that window), set once the cache dtype is known.
        self._attn_read_groups: list[tuple[int | None, int]] = []
        # CUDA graphs for decode steps (executor/cuda_graphs.py): the mode the worker planned before the pool was
        # allocated ("cuda", "emulate" or None), and the captured graphs once it is.
        self.graph_mode: str | None = None
        self.graphs: DecodeGraphs | None = None

    def block_bytes(self, kv_dtype: torch.dtype) -> int:
        """K and V of one block over all layers (with int8's scales), a speculative draft's layers included."""
        draft = self.spec.block_bytes(kv_dtype) if self.spec is not None else 0
        return draft + sum(kv_quant.block_bytes(self.block_size, a.num_kv_heads, a.head_dim, kv_dtype)
                           for a in self.kv_groups[0].layers)

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes(self.kv_dtype)

    def configure_kv_groups(self, off: OffReasons) -> tuple[int | None, ...]:
        """Group the attention layers by window (executor/kv_groups.py) before the pool is sized; returns each
        group's window, for the core's block tables."""
        self.kv_groups = plan_kv_groups(self.attn_layers, self.model_windows, off)
        hybrid = len(self.kv_groups) > 1
        for g, group in enumerate(self.kv_groups):
            for a in group.layers:
                a.kv_group = g if hybrid else None
        self.input_batch = InputBatch(self.block_size, self.device, self.vocab_size, len(self.kv_groups))
        log.info("KV cache: %s", describe(self.kv_groups))
        return tuple(group.window for group in self.kv_groups)

    def graph_blockers(self) -> str | None:
        """Why this model's decode steps cannot replay from CUDA graphs (None: they can). Each reason is state a
        replay would not see change: per-step host work inside the forward, or Python attributes set by it."""
        from tokenmill.layers.moe import FusedMoE

        if self.backend.graph_buffers(1, 1, 0) is None:
            return f"attention backend {self.backend.name} has no fixed-address metadata"
        reasons = [
            (self.lora is not None, "LoRA adapters (slots chosen per step on the host)"),
            (self.token_split is not None, "context parallelism"),
            # getattr: DecoderForCausalLM sets pp_size, WeightStore / HostOffload weight_store; other models not
            (getattr(self.model, "pp_size", 1) > 1, "pipeline parallelism"),
            (getattr(self.model, "weight_store", None) is not None, "streamed or host-offloaded weights"),
            (self.attn_timer is not None and self.attn_timer.sync,
             f"attention timing ({TIME_ATTENTION_ENV}=1: it synchronises the device per layer)"),
            (any(isinstance(m, FusedMoE) and not m.graph_safe() for m in self.model.modules()),
             "MoE layers whose routing copies counts to the host"),
        ]
        return next((why for bad, why in reasons if bad), None)

    def capture_graphs(self, max_num_seqs: int, max_blocks: int, query_lens: tuple[int, ...] = (1,)) -> None:
        """Capture the graphs (worker, after allocate_kv_cache; the pad block is the one past the pool): decodes,
        and with speculative decoding chain verifications (query_lens 1 and k + 1) where the backend takes them."""
        def buffers(q: int) -> list:
            return [self.backend.graph_buffers(max_num_seqs, max_blocks, self.num_blocks, q) for _ in self.kv_groups]

        per_group = buffers(max(query_lens))
        if any(b is None for b in per_group):  # more tokens per request than the backend's graphs take
            query_lens, per_group = (1,), buffers(1)
        graphs = DecodeGraphs(self.model, per_group, capture_sizes(max_num_seqs), self.device, self.graph_mode,
                              query_lens)
        t0 = time.perf_counter()
        try:
            graphs.capture()
        except RuntimeError as e:  # a kernel that cannot be captured: say so and stay eager
            log.warning("CUDA graphs off: capturing the decode forward failed (%s); every step runs eagerly", e)
            return
        self.graphs = graphs
        log.info("CUDA graphs: batches of %s requests x %s tokens captured in %.1f s (--enforce-eager turns them off)",
                 ", ".join(map(str, graphs.sizes)), " or ".join(map(str, query_lens)), time.perf_counter() - t0)

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        # With CUDA graphs, one block more than the scheduler's pool: the pad block of padded decode batches.
        self.backend.allocate_kv_cache(self.kv_groups[0].layers, num_blocks + (self.graph_mode is not None), kv_dtype)
        share_kv_cache(self.kv_groups)
        if self.spec is not None:
            self.spec.allocate_kv_cache(num_blocks, kv_dtype)
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
        """Every layer's K and V pool (and int8's scales), each indexed by block on its first dimension; a
        draft's too, so prefix blocks moved between tiers keep the draft's KV."""
        caches = [t for a in self.kv_groups[0].layers for t in kv_quant.layer_caches(a)]
        return caches + self.spec.kv_caches() if self.spec is not None else caches

    def mark_initialized(self, block_ids: torch.Tensor) -> None:
        self.backend.mark_initialized(block_ids)
        if self.spec is not None:
            self.spec.mark_initialized(block_ids)

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        if self.spec is not None:
            for rid in batch.finished_req_ids:
                self.spec.forget(rid)
        self.input_batch.update(batch)
        self._path_rows = None
        if not batch:
            return ModelRunnerOutput()
        if getattr(self.model, "pp_size", 1) > 1:  # DecoderForCausalLM sets it
            return self._execute_stage(batch, t0)
        inp = self.input_batch.prepare(batch)
        if self.lora is not None:
            self.lora.prepare(inp.requests, batch.num_scheduled_tokens)
        graph = self.graphs.key_for(inp) if self.graphs is not None else None  # a uniform batch a graph takes
        meta = self._metadata(inp) if graph is None else None
        timer = self.attn_timer
        if timer is not None:
            timer.total = 0.0
        clock = ForwardClock(self.device)
        clock.start()
        split = self.token_split
        if graph is not None:
            hidden = self.graphs.run(inp, graph)
        elif split is None:
            hidden = self.model(inp.input_ids, inp.positions, meta)
        else:
            T = inp.input_ids.shape[0]
            hidden = split.gather(self.model(split.local(inp.input_ids), split.local(inp.positions), meta), T)
        logits = self.model.compute_logits(hidden[inp.sample_rows]) if inp.sample_rows.numel() else None
        clock.stop()  # (no device sync: CUDA events, read after the results' copy to the host)
        collective_s = collectives.take_time()
        out = self._sample(logits, inp, batch) if logits is not None else ModelRunnerOutput()
        prompt_lps = self._prompt_logprobs(hidden, inp)
        out.prompt_logprobs = prompt_lps
        forward_s = clock.seconds()
        if self.spec is not None:
            self._propose(inp, batch, hidden, out, forward_s)
        layout = inp.layout
        out.timings = StepTimings(
            prepare_s=clock.t0 - t0, forward_s=forward_s,
            sample_s=max(time.perf_counter() - clock.t0 - forward_s, 0.0),  # the step's wall time after its forward
            kv_tokens=inp.kv_tokens,
            attn_pairs=inp.attn_pairs, attn_s=timer.total if timer is not None else 0.0,
            attn_bytes=self.attn_read_bytes(layout.query_len, layout.kv_len), collective_s=collective_s,
            weight_wait_s=self._weight_wait())
        return out

    def _weight_wait(self) -> float:
        store = getattr(self.model, "weight_store", None)  # set by WeightStore / HostOffload only
        return store.take_wait() if store is not None else 0.0

    def _metadata(self, inp: StepInputs):
        """The backend's metadata for the step: one, or one per KV cache group (each layer picks its group's)."""
        meta = self.backend.build_metadata(inp.layout)
        if not inp.group_layouts:
            return meta
        return GroupedMetadata([meta, *(self.backend.build_metadata(lay) for lay in inp.group_layouts)])

    # ---- pipeline parallelism -------------------------------------------------------------------
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

    def _sampling_metadata(self, inp: StepInputs, batch: ScheduledBatch) -> SamplingMetadata:
        """One row per sampled row, gathered from the state the input batch converted at admission: a
        draft row's penalties count the drafts before it as output, and min_tokens bans stop tokens and
        EOS on each row by the output position that row scores."""
        meta = self.input_batch.sampling_metadata(inp)
        if batch.structured_output_rows:
            grammar_rows, bitmask_rows = [], []  # sampled rows under a grammar, and their rows of the bitmask
            row = 0
            for r, rows in zip(inp.requests, inp.rows_per_request):
                first = batch.structured_output_rows.get(r.req_id)
                if first is not None and rows:
                    grammar_rows.extend(range(row, row + rows))
                    bitmask_rows.extend(range(first, first + rows))
                row += rows
            if grammar_rows:
                upload = self.input_batch.uploader.upload
                meta.grammar_rows = upload(np.asarray(grammar_rows, dtype=np.int64))
                meta.grammar_bitmask = upload(batch.grammar_bitmask[np.asarray(bitmask_rows, dtype=np.int64)])
        return meta

    def _sample(self, logits: torch.Tensor, inp: StepInputs, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Sample every sampled row; a request with drafts has its rows verified against them."""
        faults.maybe_raise("sample", (r.req_id for r, n in zip(inp.requests, inp.rows_per_request) if n))
        self.input_batch.reseed(inp)
        meta = self._sampling_metadata(inp, batch)
        if not batch.spec_token_ids:
            return self._result(inp, self.sampler(logits, meta), None)
        # Exact rejection sampling against each draft's q (a point mass for n-gram and greedy drafts).
        raw, greedy_ids, probs = target_distribution(logits, meta)
        if inp.spec_parents:  # some drafts are trees: every request's verified as one (a chain is a tree too)
            return self._verify_trees(inp, raw, greedy_ids, probs, meta)
        reqs = [(r, rows, spec) for r, rows, spec in zip(inp.requests, inp.rows_per_request, inp.spec) if rows]
        draft_probs = [self.spec.probs_for(r.req_id, len(spec)) if self.spec is not None and spec else None
                       for r, _, spec in reqs]
        tokens, num_accepted = rejection_sample(
            probs if probs is not None else raw, greedy_ids, [rows for _, rows, _ in reqs],
            [spec for _, _, spec in reqs], draft_probs, [r.params.greedy for r, _, _ in reqs], meta.seeds,
            meta.all_seeded)
        return self._result(inp, Sampler.output(raw, tokens, meta), num_accepted)

    def _verify_trees(self, inp: StepInputs, raw: torch.Tensor, greedy_ids: torch.Tensor, probs: torch.Tensor | None,
                      meta: SamplingMetadata) -> ModelRunnerOutput:
        """Verify every sampled request's drafts as a tree (point-mass drafts: tree proposers draft
        deterministically), move the accepted paths' K/V into place, and emit each path and one token more."""
        trees, batch_index, greedy = [], [], []
        row = 0
        for i, (r, rows, spec, parents) in enumerate(zip(inp.requests, inp.rows_per_request, inp.spec,
                                                         inp.spec_parents)):
            if not rows:
                continue
            trees.append(TreeDraft(row, spec, parents if parents is not None else chain(len(spec))))
            batch_index.append(i)
            greedy.append(r.params.greedy)
            row += rows
        tokens, on_path, walk = verify_on_device(probs, greedy_ids, trees, greedy, meta.seeds)
        # The paths come back with the tokens (one copy); their K/V moves after it, on the device.
        tokens_h, lp, path = Sampler.output(raw, tokens, meta).to_host(on_path)
        emit_rows = walk.emit_rows(np.asarray(path, dtype=bool))
        self._path_rows = self._compact_accepted_paths(inp, trees, batch_index, emit_rows)
        return self._emit(inp, tokens_h, lp, None, emit_rows)

    def _compact_accepted_paths(self, inp: StepInputs, trees: list[TreeDraft], batch_index: list[int],
                                emit_rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A tree's accepted nodes hold their K/V at their own slots (c + 1 + node); the path's must be at
        c + 1 .. c + a, where the next step reads them: copied there in every layer of every KV cache group
        (nothing to do where the path is nodes 0 .. a - 1, as a chain's always is). Returns the packed rows
        moved (source, destination), for the hidden states the proposers read the same way (None: none)."""
        lay = inp.layout
        q_end = (lay.query_start + lay.query_len).tolist()
        src, dst = [], []
        for t, i, rows in zip(trees, batch_index, emit_rows):
            path = [r - t.root_row - 1 for r in rows[1:]]
            if path == list(range(len(path))):
                continue
            first = q_end[i] - len(t.tokens)  # packed row of node 0
            src += [first + m for m in path]
            dst += [first + j for j in range(len(path))]
        if not src:
            return None
        src_rows, dst_rows = torch.tensor(src), torch.tensor(dst)
        upload = self.input_batch.uploader.upload
        for g, group in enumerate(self.kv_groups):
            slots = (lay if g == 0 else inp.group_layouts[g - 1]).slot_mapping
            s, d = upload(slots[src_rows]), upload(slots[dst_rows])
            for a in group.layers:
                for cache in kv_quant.layer_caches(a):
                    flat = cache.view(-1, *cache.shape[2:])
                    flat.index_copy_(0, d, flat.index_select(0, s))
        return src_rows, dst_rows

    def _result(self, inp: StepInputs, sampled: SamplerOutput, accepted: torch.Tensor | None) -> ModelRunnerOutput:
        tokens, lp, num_accepted = sampled.to_host(accepted)  # the step's one copy of its results to the host
        return self._emit(inp, tokens, lp, num_accepted)

    def _emit(self, inp: StepInputs, tokens: list[int], lp, num_accepted: list[int] | None,
              emit_rows: list[list[int]] | None = None) -> ModelRunnerOutput:
        """Per request: its sampled rows' tokens, cut after the accepted drafts and the one token that
        follows them (trees: the rows of its accepted path and the one after, `emit_rows`)."""
        result = ModelRunnerOutput()
        row = j = 0
        for r, rows in zip(inp.requests, inp.rows_per_request):
            if not rows:
                continue
            n = num_accepted[j] + 1 if num_accepted is not None else rows
            emitted = emit_rows[j] if emit_rows is not None else range(row, row + n)
            j += 1
            result.req_ids.append(r.req_id)
            result.sampled_token_ids.append([tokens[i] for i in emitted] if emit_rows is not None
                                            else tokens[row : row + n])
            if lp is not None and r.params.logprobs is not None:
                k = r.params.logprobs
                result.logprobs[r.req_id] = [
                    (lp[0][i], lp[1][i], lp[2][i][:k], lp[3][i][:k]) for i in emitted]
            row += rows
        return result

    def _propose(self, inp: StepInputs, batch: ScheduledBatch, hidden: torch.Tensor, out: ModelRunnerOutput,
                 forward_s: float) -> None:
        """Record what the step cost and what verification accepted, then draft the next step."""
        from tokenmill.spec_decode.draft import StepView

        sampled = dict(zip(out.req_ids, out.sampled_token_ids))
        verified = [(len(sp), len(sampled[r.req_id]) - 1) for r, sp in zip(inp.requests, inp.spec)
                    if sp and r.req_id in sampled]
        self.spec.observe(batch.num_tokens, forward_s, verified)
        lay = inp.layout
        aux = getattr(self.model, "aux_hidden_states", None)  # EAGLE-3 targets only
        moved, self._path_rows = self._path_rows, None
        if moved is not None:  # accepted tree paths: their hidden rows in chain order too, as their K/V
            src, dst = (self.input_batch.uploader.upload(x) for x in moved)
            hidden = hidden.index_copy(0, dst, hidden.index_select(0, src))
            aux = aux.index_copy(0, dst, aux.index_select(0, src)) if aux is not None else None
        view = StepView(inp.requests, lay.kv_len.numpy() - lay.query_len.numpy(), list(batch.num_scheduled_tokens),
                        lay.query_start.numpy(), [sampled.get(r.req_id) for r in inp.requests], hidden, aux)
        out.spec_token_ids, out.spec_parents = self.spec.propose(view)

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: StepInputs) -> dict[str, PromptLogprobs]:
        """Every prompt-logprob request's rows in one LM-head pass and one copy to the host (a copy per list
        per request before: four device syncs each)."""
        if not inp.prompt_rows:
            return {}
        logits = self.model.compute_logits(torch.cat([hidden[row : row + n] for _, row, n, _ in inp.prompt_rows]))
        targets = [r.token_ids[pos + 1 : pos + 1 + n] for r, _, n, pos in inp.prompt_rows]
        K = max(max(r.params.prompt_logprobs, 1) for r, _, _, _ in inp.prompt_rows)
        flat = self.input_batch.uploader.upload(np.fromiter((t for ts in targets for t in ts), np.int64,
                                                            logits.shape[0]))
        lp, top_lp, top_ids, ranks = compute_logprobs(logits, flat, K)
        N, K = top_ids.shape
        host = torch.cat([lp.double(), ranks.double(), top_ids.double().reshape(-1),
                          top_lp.double().reshape(-1)]).cpu().numpy()
        lps, rks = host[:N].tolist(), host[N : 2 * N].astype(np.int64).tolist()
        ids = host[2 * N : 2 * N + N * K].astype(np.int64).reshape(N, K)
        tops = host[2 * N + N * K :].reshape(N, K)
        out, at = {}, 0
        for (r, _, n, pos), tgt in zip(inp.prompt_rows, targets):
            k = r.params.prompt_logprobs
            out[r.req_id] = PromptLogprobs(pos, tgt, lps[at : at + n], rks[at : at + n], ids[at : at + n, :k].tolist(),
                                           tops[at : at + n, :k].tolist())
            at += n
        return out


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
    from dataclasses import replace

    return replace(inputs[0], requests=[r for i in inputs for r in i.requests],
                   rows_per_request=[n for i in inputs for n in i.rows_per_request],
                   spec=[s for i in inputs for s in i.spec])
