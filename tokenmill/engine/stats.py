"""Where the engine core's time goes, step by step (for metrics and the roofline report). No torch."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class StepStats:
    """Where one step's time went, and how many tokens it processed."""

    schedule_s: float = 0.0
    prepare_s: float = 0.0  # batch -> tensors, attention metadata
    forward_s: float = 0.0  # the model's forward pass and logits
    sample_s: float = 0.0
    detokenize_s: float = 0.0
    offload_s: float = 0.0  # KV tier saves/loads before the forward pass
    grammar_s: float = 0.0  # filling the structured-output token bitmask
    num_tokens: int = 0
    num_requests: int = 0
    num_sampled: int = 0
    kv_tokens: int = 0  # cached tokens read by attention (sum of context lengths)
    attn_pairs: int = 0  # (query, key) pairs computed by attention
    attn_s: float = 0.0  # inside the attention backend (part of forward_s; 0: not timed)
    attn_bytes: int = 0  # K/V bytes attention must read
    collective_s: float = 0.0  # tensor parallelism's all-reduces / all-gathers (part of forward_s)
    weight_wait_s: float = 0.0  # --weights-resident-gb: waiting for streamed layers' reads (part of forward_s)
    end_time: float = 0.0  # perf_counter at the end of the step
    idle_before_s: float = 0.0  # serving-loop idle time since the previous step in the history

    @property
    def busy_s(self) -> float:
        return (self.schedule_s + self.offload_s + self.grammar_s + self.prepare_s + self.forward_s + self.sample_s
                + self.detokenize_s)


@dataclass
class EngineStats:
    steps: int = 0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    detokenize_s: float = 0.0
    offload_s: float = 0.0
    grammar_s: float = 0.0
    attn_s: float = 0.0  # part of forward_s
    attn_bytes: int = 0
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
        self.attn_s += s.attn_s
        self.attn_bytes += s.attn_bytes
        self.num_tokens += s.num_tokens
        self.sample_s += s.sample_s
        self.detokenize_s += s.detokenize_s
        self.offload_s += s.offload_s
        self.grammar_s += s.grammar_s
        self.last = s
