"""LLMEngine: the offline engine, all in this process.

processor (tokenize, validate) -> EngineCore.step() (schedule, execute, update) -> OutputProcessor
(detokenize, stop strings, logprobs) -> RequestOutputs. The server uses the same three parts with the
core in a thread or a process of its own (async_engine.py).
"""
from __future__ import annotations

import logging
import time

from tokenmill.config import EngineConfig
from tokenmill.core.request import RequestSLO, RequestStatus
from tokenmill.engine.core import EngineCore
from tokenmill.engine.output import OutputProcessor, RequestState
from tokenmill.engine.processor import ModelFacts, Processor, RequestOptions, child_ids
from tokenmill.lora.request import LoRARequest
from tokenmill.engine.stats import EngineStats, StepStats  # noqa: F401  (re-exported)
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def model_facts(config: EngineConfig, core_info, tokenizer, load_time_s: float = 0.0) -> ModelFacts:
    from tokenmill.model.loader import eos_token_ids

    eos = eos_token_ids(config.model.model, tokenizer)
    return ModelFacts(core_info.max_model_len, core_info.vocab_size, frozenset(eos), core_info.num_blocks,
                      core_info.block_size, load_time_s, int(core_info.model_cost.weight_bytes),
                      core_info.bytes_per_block, core_info.lora_shapes, core_info.num_layers,
                      config.lora.max_lora_rank if config.lora is not None else 0, core_info.hidden_size,
                      config.model.pooling)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        from tokenmill.model.default import resolve_model_config
        from tokenmill.model.loader import load_tokenizer

        resolve_model_config(config.model)  # Hub ids -> the Hugging Face cache
        t0 = time.monotonic()
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model.model, config.model.tokenizer)
        self.core = EngineCore(config, self.tokenizer)
        self.facts = model_facts(config, self.core.info, self.tokenizer, time.monotonic() - t0)
        self.processor = Processor(self.tokenizer, self.facts)
        self.output_processor = OutputProcessor(self.tokenizer)

    # ---- facts and parts (tests and tools read these) -----------------------------------
    max_model_len = property(lambda self: self.facts.max_model_len)
    vocab_size = property(lambda self: self.facts.vocab_size)
    eos_token_ids = property(lambda self: self.facts.eos_token_ids)
    load_time_s = property(lambda self: self.facts.load_time_s)
    scheduler = property(lambda self: self.core.scheduler)
    kv = property(lambda self: self.core.kv)
    stats = property(lambda self: self.core.stats)
    groups = property(lambda self: self.output_processor.requests)

    @property
    def _worker(self):
        worker = getattr(self.core.executor, "worker", None)  # UniProcExecutor has one; mp / ray executors do not
        if worker is None:
            raise AttributeError("the model lives in a worker process (distributed_executor_backend='mp').")
        return worker

    runner = property(lambda self: self._worker.runner)
    model = property(lambda self: self._worker.runner.model)
    hf_config = property(lambda self: self._worker.hf_config)
    transfer = property(lambda self: self._worker.transfer)

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.processor.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        slo: RequestSLO | None = None,
        cache_salt: str | None = None,
    ) -> RequestState:
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        options = RequestOptions(priority, arrival_time, lora_request, slo, cache_salt)
        prompt, ids, params, reqs = self.processor.process(request_id, prompt, params, prompt_token_ids, options)
        state = self.output_processor.add_request(request_id, prompt, ids, params, reqs[0].arrival_time,
                                                  child_ids(request_id, params.n))
        for r in reqs:
            self.core.add_request(r)
        return state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.output_processor.abort(request_id)
        if state is None:
            return None
        self.output_processor.remove(request_id)
        self.core.abort_requests(state.child_ids)
        return self.output_processor.make_output(state)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        result = self.core.step()
        if result.step is None and not result.outputs:  # outputs without a step: requests the core refused
            return []
        t0 = time.perf_counter()
        touched, stops = self.output_processor.process_outputs(result.outputs)
        for child_id, stop in stops:  # finished by a stop string, or failed in output processing
            failed = self.output_processor.failed(child_id)
            status = RequestStatus.FINISHED_ABORTED if failed else RequestStatus.FINISHED_STOPPED
            self.core.abort_requests([child_id], status, stop)
        outputs = []
        for state in touched:
            outputs.append(self.output_processor.make_output(state))
            if state.finished:
                self.output_processor.remove(state.request_id)
        if result.step is not None:
            result.step.detokenize_s = time.perf_counter() - t0
            self.core.stats.detokenize_s += result.step.detokenize_s
        return outputs

    def shutdown(self) -> None:
        self.core.shutdown()
