"""A request's state machine: waiting -> running <-> preempted -> finished. No torch."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestSLO:
    """A request's latency targets, in milliseconds (None: no target). A request without an SLO is batch work
    to the `slo` scheduling policy."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms)):
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"slo {name} must be a positive number of milliseconds, got {v!r}.")

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """One sequence being generated. `n` > 1 becomes n Requests that share a prompt (and its cached blocks)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never beyond max_model_len
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache on first admission (-1: not yet admitted)
    num_preemptions: int = 0
    admission_skips: int = 0  # steps it was passed over in the queue because the pool could not hold it
    # Its block table per KV cache group (kv_cache.py: layers of one attention type share a group; one group unless
    # the model mixes sliding-window and full layers). Every table has one entry per block of the sequence.
    tables: list[list[int]] = field(default_factory=lambda: [[]])
    # Per group: leading entries released out of the group's attention window (kv_cache.RELEASED).
    num_released: list[int] = field(default_factory=lambda: [0])
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of this request's full blocks, in order
    extra_keys: tuple = ()  # mixed into every block hash: reserved for adapters (LoRA) and multimodal inputs
    stop_reason: int | str | None = None
    index: int = 0  # which of the group's n sequences
    seed: int | None = None  # this sequence's own sampling seed (params.seed + index)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    spec_parents: list[int] | None = None  # the drafts' tree (each node's parent; -1: the last token); None: a chain
    grammar: Any = None  # structured_output.manager.RequestGrammar of a constrained request
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    slo: RequestSLO | None = None  # latency targets (the slo scheduling policy); None: batch work
    # Timestamps for metrics (monotonic seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        # Looked up for every new token: a set, built once (the list can hold up to --max-stop-token-ids ids).
        self.stop_token_ids: frozenset[int] = frozenset(self.params.stop_token_ids or ())
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # What the worker holds of this request (see core/batch.py): None until sent, and again after a
        # preemption; else (tokens, blocks) it has.
        self.sent: tuple[int, int] | None = None

    @property
    def block_ids(self) -> list[int]:
        """The first group's block table (the only one for most models; a full-attention group when there is one)."""
        return self.tables[0]

    @block_ids.setter
    def block_ids(self, ids: list[int]) -> None:
        self.tables[0] = ids

    @property
    def num_held_blocks(self) -> int:
        """Blocks it holds over all groups (released entries not counted; shared blocks counted once per holder)."""
        return sum(len(t) for t in self.tables) - sum(self.num_released)

    def held_block_ids(self):
        """Every block it holds, all groups."""
        for table, released in zip(self.tables, self.num_released):
            yield from table[released:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than one token is uncomputed (a prompt, or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def pooling(self) -> str | None:
        """An embedding request's pooling ("last" | "mean": the processor resolves the engine's; unresolved is
        "last", as the runner reads it); None: it generates."""
        p = self.params.pooling
        return (p.pooling or "last") if p is not None else None

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether a prefix-cache hit may stand in for computing its first tokens: not when the output needs every
        prompt position computed (prompt logprobs; mean pooling, whose mean is over every position's hidden
        state, which a cached block does not hold: only its K/V)."""
        return self.params.prompt_logprobs is None and self.pooling != "mean"

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass
class EngineCoreRequest:
    """A sequence as the processor hands it to the engine core (picklable: it may cross to the core process)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = 0.0
    index: int = 0
    seed: int | None = None
    lora: LoRARequest | None = None
    slo: RequestSLO | None = None
    # Mixed into every block hash with the adapter's key: requests with different salts (tenants outside one
    # cache group, vLLM's `cache_salt`) never share prefix-cache blocks, so neither can probe the other's prompts.
    cache_salt: str | None = None

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.params, self.max_tokens, self.eos_token_ids,
                       self.priority, self.arrival_time, index=self.index, seed=self.seed, lora=self.lora,
                       slo=self.slo, extra_keys=self.cache_keys())

    def cache_keys(self) -> tuple:
        keys = self.lora.cache_key if self.lora is not None else ()
        return keys + (("salt", self.cache_salt),) if self.cache_salt else keys
