"""What the engine core returns after a step (picklable: it crosses from the core process). No torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.batch import PromptLogprobs, TokenLogprobs


@dataclass
class EngineCoreOutput:
    """One sequence's progress in one step: only accepted tokens, already cut at EOS/stop ids/length."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished in the core
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Monotonic timestamps (CLOCK_MONOTONIC is system-wide, so they compare across processes).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Finished because its grammar was complete: the last token is text, not an EOS or stop token.
    grammar_done: bool = False
    error: str | None = None  # the request failed in the core: a grammar that did not compile (400), a step (500)
    error_status: int = 400
    error_code: str | None = None  # OpenAI's error `code` (None: derived from the status)
    # An embedding request's pooled final hidden state (raw: the output processor normalises and truncates it).
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """Counters and gauges for metrics, sent with every step's outputs."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_evictions: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    offload: dict[str, int] | None = None  # saves, spills, host_loads, disk_loads, load_failures
    spec: dict | None = None  # speculative decoding: spec_stats.SpecDecodingStats.as_dict()
    kv_transfer: dict | None = None  # prefill/decode hand-over: bytes, seconds, blocks exported/imported/failed


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    step: Any = None  # engine.stats.StepStats of a step that ran, else None
    stats: SchedulerStats | None = None
    idle_s: float = 0.0  # the core loop's total idle time so far
    num_added: int = 0  # requests the core loop has taken so far (the client counts the ones in transit)
