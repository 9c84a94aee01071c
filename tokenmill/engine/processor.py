"""Processor: prompt text or ids + SamplingParams -> validated EngineCoreRequests (one per sequence of n).
Runs on the caller's side (the API process under `serve`), so tokenizing never holds the step loop."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from tokenmill.core.request import EngineCoreRequest, RequestSLO
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

SEED_RANGE = 2**63  # torch generators take non-negative 64-bit seeds


@dataclass
class ModelFacts:
    """What the caller's side knows of the model the core runs (picklable, sent once at start-up)."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_blocks: int = 0
    block_size: int = 0
    load_time_s: float = 0.0
    weight_bytes: int = 0  # resident: packed bytes for quantized weights
    kv_bytes_per_block: int = 0  # K and V (and their scales) of one block over all layers
    lora_shapes: dict | None = None  # --enable-lora: projection -> (in, out), to check adapters at admission
    num_layers: int = 0
    max_lora_rank: int = 0
    hidden_size: int = 0  # the final hidden state's size: an embedding's (0: unknown)
    pooling: str = "last"  # the engine's pooling (--pooling) for embedding requests that do not choose


@dataclass(frozen=True)
class RequestOptions:
    """How a request is admitted beyond its prompt and sampling params: the same for every entry point (the
    offline engine, the server's), so the processor takes them as one."""

    priority: int = 0
    arrival_time: float | None = None  # monotonic seconds; None: now
    lora_request: LoRARequest | None = None
    slo: RequestSLO | None = None
    cache_salt: str | None = None


def child_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


class Processor:
    def __init__(self, tokenizer, facts: ModelFacts) -> None:
        self.tokenizer = tokenizer
        self.facts = facts
        self._checked_adapters: set[tuple] = set()  # cache keys of adapters read and checked here

    def check_lora(self, lora: LoRARequest | None) -> None:
        """An adapter is read and checked against the model once, here (a bad one is this caller's ValueError,
        naming the file and the reason), before any request with it reaches the core."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}.")
        if lora.cache_key in self._checked_adapters:
            return
        if self.facts.lora_shapes is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} requested, but this engine runs without adapters "
                             "(start it with --enable-lora).")
        from tokenmill.lora.manager import load_adapter
        from tokenmill.lora.peft import check_shapes

        adapter = load_adapter(lora, self.facts.max_lora_rank)
        check_shapes(adapter, self.facts.lora_shapes, self.facts.num_layers)
        self._checked_adapters.add(lora.cache_key)

    def forget_lora(self, lora: LoRARequest) -> None:
        self._checked_adapters.discard(lora.cache_key)

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def process(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams | None = None,
                prompt_token_ids: list[int] | None = None, options: RequestOptions = RequestOptions(),
                ) -> tuple[str | None, list[int], SamplingParams, list[EngineCoreRequest]]:
        """Returns (prompt text, prompt ids, params, core requests); raises ValueError on bad input."""
        params = params or SamplingParams()
        if isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt must be given as text or token ids.")
            if not prompt:
                raise ValueError("prompt must not be empty.")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate_prompt(prompt_token_ids, embedding=params.pooling is not None)
        params = self.check_params(params)
        self.check_lora(options.lora_request)
        if params.structured_outputs is not None:
            from tokenmill.structured_output.grammar import validate

            validate(params.structured_outputs)  # a bad schema/regex/grammar is the caller's 400, not the core's
        arrival = options.arrival_time if options.arrival_time is not None else time.monotonic()
        slo = options.slo
        room = self.facts.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.pooling is not None:
            max_tokens = 0  # an embedding request ends with its prompt
        # The prompt's logprobs are the same for all n sequences: only the first computes them (the output
        # processor reads them from it). The others read its prompt KV from the prefix cache, which a request
        # with prompt logprobs cannot (it computes every row), instead of computing the prompt n times.
        rest = replace(params, prompt_logprobs=None) if params.prompt_logprobs is not None and params.n > 1 else params
        reqs = [
            EngineCoreRequest(cid, prompt_token_ids, params if i == 0 else rest, max_tokens, self.facts.eos_token_ids,
                              options.priority, arrival, index=i,
                              seed=None if params.seed is None else (params.seed + i) % SEED_RANGE,
                              lora=options.lora_request, slo=slo if slo is not None and not slo.empty else None,
                              cache_salt=options.cache_salt)
            for i, cid in enumerate(child_ids(request_id, params.n))
        ]
        return prompt, prompt_token_ids, params, reqs

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """Every value the core turns into a tensor, checked against the model here, at admission: a bad value
        is this caller's ValueError, never a failure inside a batched step that other requests share."""
        vocab, max_len = self.facts.vocab_size, self.facts.max_model_len
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs must be at most the vocabulary size {vocab}, got {params.logprobs}.")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise ValueError(f"prompt_logprobs must be at most the vocabulary size {vocab}, got {params.prompt_logprobs}.")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids contains token id {bad[0]}, outside the vocabulary [0, {vocab}).")
        bad = [t for t in params.logit_bias or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab}).")
        if params.min_tokens > max_len:
            raise ValueError(f"min_tokens must be at most max_model_len {max_len}, got {params.min_tokens}.")
        changes = {}
        if params.top_k >= vocab:  # keeps every token: the same as no top-k
            changes["top_k"] = 0
        if params.seed is not None and not 0 <= params.seed < SEED_RANGE:
            changes["seed"] = params.seed % SEED_RANGE  # negative seeds are valid for OpenAI
        pooling = params.pooling
        if pooling is not None:
            hidden = self.facts.hidden_size
            if pooling.dimensions is not None and hidden and pooling.dimensions > hidden:
                raise ValueError(f"dimensions must be at most the model's hidden size {hidden}, "
                                 f"got {pooling.dimensions}.")
            if pooling.pooling is None:  # the engine's choice, fixed here: the core and workers read it off the request
                changes["pooling"] = replace(pooling, pooling=self.facts.pooling)
        return replace(params, **changes) if changes else params

    def validate_prompt(self, ids: list[int], embedding: bool = False) -> None:
        """`embedding`: the prompt of an embedding request, which generates nothing (it may fill max_model_len)."""
        max_len = self.facts.max_model_len
        if not ids:
            raise ValueError("prompt must not be empty.")
        if embedding and len(ids) > max_len:
            raise ValueError(f"input is {len(ids)} tokens, but max_model_len is {max_len}: the input to embed must "
                             f"be at most max_model_len tokens.")
        if not embedding and len(ids) >= max_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, but max_model_len is {max_len}: "
                f"the prompt must be shorter than max_model_len to leave room for at least one generated token."
            )
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.facts.vocab_size:
            raise ValueError(
                f"prompt token id {hi if hi >= self.facts.vocab_size else lo} is outside the vocabulary "
                f"[0, {self.facts.vocab_size}).")
