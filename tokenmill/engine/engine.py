"""LLMEngine: one step = schedule -> forward -> sample -> update requests -> detokenize -> outputs."""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.executor.kv_transfer import build_offload
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.sample.sampler import Sampler, SamplingMetadata, compute_logprobs
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Where one step's time went, and how many tokens it processed."""

    schedule_s: float = 0.0
    prepare_s: float = 0.0  # batch -> tensors, attention metadata
    forward_s: float = 0.0  # the model's forward pass and logits
    sample_s: float = 0.0
    detokenize_s: float = 0.0
    offload_s: float = 0.0  # KV tier saves/loads before the forward pass
    num_tokens: int = 0
    num_requests: int = 0
    num_sampled: int = 0
    kv_tokens: int = 0  # cached tokens read by attention (sum of context lengths)
    attn_pairs: int = 0  # (query, key) pairs computed by attention
    end_time: float = 0.0  # perf_counter at the end of the step
    idle_before_s: float = 0.0  # serving-loop idle time since the previous step in the history

    @property
    def busy_s(self) -> float:
        return self.schedule_s + self.offload_s + self.prepare_s + self.forward_s + self.sample_s + self.detokenize_s


@dataclass
class EngineStats:
    steps: int = 0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    detokenize_s: float = 0.0
    offload_s: float = 0.0
    num_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    idle_s: float = 0.0  # time the serving loop waited with nothing to do
    last: StepStats = field(default_factory=StepStats)
    history: deque = field(default_factory=lambda: deque(maxlen=4096))  # recent non-empty steps
    _idle_seen: float = 0.0  # idle_s when the last step entered the history

    def add(self, s: StepStats) -> None:
        if s.num_tokens:
            s.idle_before_s, self._idle_seen = self.idle_s - self._idle_seen, self.idle_s
            self.history.append(s)
        self.steps += 1
        self.schedule_s += s.schedule_s
        self.prepare_s += s.prepare_s
        self.forward_s += s.forward_s
        self.num_tokens += s.num_tokens
        self.sample_s += s.sample_s
        self.detokenize_s += s.detokenize_s
        self.offload_s += s.offload_s
        self.last = s


@dataclass(eq=False)
class RequestGroup:
    """A user request: n sequences sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    generators: list[torch.Generator | None]
    logprobs: list[list[dict[int, Logprob]]] | None
    cumulative_logprob: list[float]
    prompt_logprobs: list | None
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        from tokenmill.model.default import resolve_model
        from tokenmill.model.loader import generation_eos_ids, load_model, load_tokenizer

        config.validate()
        self.config = config
        mc = config.model
        mc.model = resolve_model(mc.model)
        t0 = time.monotonic()
        self.model, self.hf_config, self.max_model_len = load_model(mc.model, mc.dtype, mc.max_model_len, config.device)
        self.tokenizer = tokenizer or load_tokenizer(mc.model, mc.tokenizer)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.runner = ModelRunner(self.model, config.cache, self.max_model_len, config.device)
        # Lower KV tiers (host, disk): bookkeeping in the manager, copies in `transfer`, run before each forward.
        offload, self.transfer = build_offload(config.cache, self.runner)
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, offload
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.sampler = Sampler()
        eos = set(generation_eos_ids(mc.model))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.groups: dict[str, RequestGroup] = {}
        self.stats = EngineStats()
        self.load_time_s = time.monotonic() - t0
        torch.manual_seed(mc.seed)
        self._decode_token = lru_cache(maxsize=1 << 16)(lambda t: self.tokenizer.decode([t]))

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> RequestGroup:
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        if isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt must be given as text or token ids.")
            if not prompt:
                raise ValueError("prompt must not be empty.")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate_prompt(prompt_token_ids)
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size {self.vocab_size}, got {params.logprobs}.")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.vocab_size:
            raise ValueError(
                f"prompt_logprobs must be at most the vocabulary size {self.vocab_size}, got {params.prompt_logprobs}."
            )
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        children, gens = [], []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            children.append(Request(rid, prompt_token_ids, params, max_tokens, self.eos_token_ids, priority, arrival, index=i))
            if params.seed is not None:
                gens.append(torch.Generator(self.runner.device).manual_seed(params.seed + i))
            else:
                gens.append(None)
        group = RequestGroup(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            children=children,
            detoks=[IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) for _ in children],
            generators=gens,
            logprobs=[[] for _ in children] if params.logprobs is not None else None,
            cumulative_logprob=[0.0] * params.n,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            arrival_time=arrival,
        )
        for c in children:
            c.group = group
            self.scheduler.add_request(c)
        self.groups[request_id] = group
        return group

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty.")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"the prompt must be shorter than max_model_len to leave room for at least one generated token."
            )
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"prompt token id {hi if hi >= self.vocab_size else lo} is outside the vocabulary [0, {self.vocab_size}).")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for c in group.children:
            if not c.finished:
                self.scheduler.finish_request(c, RequestStatus.FINISHED_ABORTED)
        return self._make_output(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        st = StepStats()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        st.schedule_s = t1 - t0
        if self.transfer is not None:
            st.offload_s = self._run_transfers(sched)
        if not sched:
            self.stats.add(st)
            return []
        fwd = self.runner.execute(sched.scheduled)
        t2 = time.perf_counter()
        st.prepare_s = self.runner.last_prepare_s
        st.forward_s = self.runner.last_forward_s
        st.num_tokens = sched.num_tokens
        st.num_requests = len(sched.scheduled)
        st.kv_tokens = self.runner.last_kv_tokens
        st.attn_pairs = self.runner.last_attn_pairs
        touched: dict[str, RequestGroup] = {}
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
            touched[req.group.request_id] = req.group
            if id(req) in fwd.prompt_logits:
                self._record_prompt_logprobs(req, *fwd.prompt_logits[id(req)])
        self.stats.prompt_tokens += sum(
            max(0, min(req.num_computed_tokens, req.num_prompt_tokens) - max(req.num_computed_tokens - n, 0))
            for req, n in sched.scheduled
        )

        sampled: list[int] = []
        if fwd.sample_requests:
            reqs = fwd.sample_requests
            meta = SamplingMetadata.build(
                [r.params for r in reqs],
                [r.prompt_token_ids for r in reqs],
                [r.output_token_ids for r in reqs],
                [r.group.generators[r.index] for r in reqs],
                [self._banned(r) for r in reqs],
                self.vocab_size,
                self.runner.device,
            )
            out = self.sampler(fwd.logits, meta)
            sampled = out.token_ids.tolist()
            t3 = time.perf_counter()
            st.sample_s = t3 - t2
            now = time.monotonic()
            if out.logprobs is not None:
                lp, top_lp, top_ids, ranks = (out.logprobs.tolist(), out.top_logprobs.tolist(),
                                              out.top_ids.tolist(), out.ranks.tolist())
            for i, (req, tok) in enumerate(zip(reqs, sampled)):
                group = req.group
                idx = req.index
                req.append_token(tok)
                if req.first_token_time is None:
                    req.first_token_time = now
                if group.logprobs is not None and out.logprobs is not None:
                    k = group.params.logprobs
                    entry = {tok: Logprob(lp[i], ranks[i], self._decode_token(tok))}
                    for j in range(k):
                        tid = top_ids[i][j]
                        if tid not in entry:
                            entry[tid] = Logprob(top_lp[i][j], j + 1, self._decode_token(tid))
                    group.logprobs[idx].append(entry)
                    group.cumulative_logprob[idx] += lp[i]
                self._check_stop(req, tok, group.detoks[idx])
            self.stats.generation_tokens += len(sampled)
            st.num_sampled = len(sampled)
            st.detokenize_s = time.perf_counter() - t3

        outputs = []
        for group in touched.values():
            outputs.append(self._make_output(group))
            if group.finished:
                self.groups.pop(group.request_id, None)
        st.end_time = time.perf_counter()
        self.stats.add(st)
        return outputs

    def _run_transfers(self, sched) -> float:
        """Saves, spills and loads of the lower KV tiers, before the forward pass reads or overwrites
        blocks. Returns the seconds spent."""
        ops = self.kv.take_transfer_ops()
        if not ops:
            return 0.0
        failed = self.transfer.run(ops)
        if failed:
            self.scheduler.recompute_failed_loads(sched, self.kv.loads_failed(failed))
        return self.transfer.stats.last_ops_s

    def _banned(self, req: Request) -> list[int]:
        if req.num_output_tokens >= req.params.min_tokens:
            return []
        banned = list(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            banned.extend(self.eos_token_ids)
        return banned

    def _check_stop(self, req: Request, tok: int, detok: IncrementalDetokenizer) -> None:
        p = req.params
        status = None
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif tok in p.stop_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
        if status is None:
            # As in vLLM, stop strings count only once min_tokens tokens have been generated.
            stop_str = detok.update([tok], check_stop=req.num_output_tokens > p.min_tokens)
            if stop_str is not None:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish_request(req, status)

    def _record_prompt_logprobs(self, req: Request, logits: torch.Tensor, first_pos: int) -> None:
        group = req.group
        if group.children[0] is not req:
            return
        done = len(group.prompt_logprobs)  # entries recorded so far (position 0 has none)
        rows = logits.shape[0]
        if first_pos + rows + 1 <= done:
            return  # recomputed after preemption
        k = group.params.prompt_logprobs
        targets = torch.tensor(req.token_ids[first_pos + 1 : first_pos + 1 + rows], device=logits.device)
        lp, top_lp, top_ids, ranks = (x.tolist() for x in compute_logprobs(logits, targets, max(k, 1)))
        for r in range(rows):
            if first_pos + 1 + r < done:
                continue
            tok = int(targets[r])
            entry = {tok: Logprob(lp[r], ranks[r], self._decode_token(tok))}
            for j in range(k):
                tid = top_ids[r][j]
                if tid not in entry:
                    entry[tid] = Logprob(top_lp[r][j], j + 1, self._decode_token(tid))
            group.prompt_logprobs.append(entry)

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        outs = []
        for i, (req, detok) in enumerate(zip(group.children, group.detoks)):
            outs.append(CompletionOutput(
                index=i,
                text=detok.output_text,
                token_ids=req.output_token_ids,
                cumulative_logprob=group.cumulative_logprob[i] if group.logprobs is not None else None,
                logprobs=group.logprobs[i] if group.logprobs is not None else None,
                finish_reason=req.status.value if req.finished else None,
                stop_reason=req.stop_reason,
            ))
        first = group.children[0]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs,
            outputs=outs,
            finished=group.finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=RequestMetrics(group.arrival_time, first.first_scheduled_time, first.first_token_time, first.finished_time),
        )
