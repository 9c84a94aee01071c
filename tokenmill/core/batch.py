"""The only contract between the engine core and the workers: what one step computes, and what it returned.

Everything here is plain data (ints, lists, dataclasses, SamplingParams), so a batch can be pickled to
a worker process or broadcast to ranks. Requests are named by id. A worker keeps its own copy of each
running request (tokens, block table, sampling state): a request's full data crosses once, when it is
scheduled for the first time (or again after a preemption), and after that only what changed.
No torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen (or must forget and start again: resumed after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + tokens generated so far (a resumed request recomputes them)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int  # before this step (cached prefix included)
    params: SamplingParams
    seed: int | None  # the request's own generator seed (params.seed + index), None: the worker's global one
    eos_token_ids: tuple[int, ...] = ()
    lora: LoRARequest | None = None  # the adapter its tokens run with
    # KV cache groups after the first (core/kv_cache.py): each group's block table, as long as block_ids.
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """A request the worker holds: what changed since the step it last ran in."""

    req_id: str
    new_token_ids: list[int]  # tokens accepted since the worker last saw the request
    new_block_ids: list[int]  # the tail of its block table
    num_computed_tokens: int  # before this step
    block_table_len: int  # the table's length with new_block_ids (shorter before them: blocks of rejected drafts freed)
    group_new_block_ids: list[list[int]] = field(default_factory=list)  # the other groups' tails, as new_block_ids


@dataclass
class ScheduledBatch:
    """One step. `req_ids` is the batch order: the packed tokens of request i follow those of i-1."""

    req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)  # per request, spec tokens included
    # How many rows of each request's chunk are sampled: 0 (a prompt chunk that does not reach the end),
    # 1 (the usual), or k+1 with k speculative tokens (verify every draft, plus a bonus token).
    num_sample_rows: list[int] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts appended after the known tokens
    # Drafts that form a tree (spec_decode/tree.py): each node's parent index (-1: the last known token).
    # Absent: a chain.
    spec_parents: dict[str, list[int]] = field(default_factory=dict)
    # Prompt logprobs to compute: req_id -> (first position, rows) within this step's chunk.
    prompt_logprob_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)  # forget these (finished, aborted or preempted)
    # Structured output: req_id -> row of `grammar_bitmask` ([rows, ceil(V/32)] int32), filled by the core.
    structured_output_rows: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.req_ids)

    def __bool__(self) -> bool:
        return bool(self.req_ids)


# One sampled position's logprobs: (logprob of the sampled token, its rank, top ids, top logprobs).
TokenLogprobs = tuple[float, int, list[int], list[float]]


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens first_pos+1 .. first_pos+rows, each given the tokens before it."""

    first_pos: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class StepTimings:
    prepare_s: float = 0.0  # batch -> tensors, attention metadata
    forward_s: float = 0.0  # the model's forward pass and logits
    sample_s: float = 0.0
    kv_tokens: int = 0  # cached tokens read by attention (sum of context lengths)
    attn_pairs: int = 0  # (query, key) pairs computed by attention
    attn_s: float = 0.0  # wall time inside the attention backend, all layers (0: not timed)
    attn_bytes: int = 0  # K/V bytes attention must read: attended tokens x KV bytes, per layer (windows clip)
    collective_s: float = 0.0  # tensor parallelism: inside all-reduce / all-gather (part of forward_s)
    weight_wait_s: float = 0.0  # --weights-resident-gb: waiting for streamed layers' reads (part of forward_s)


@dataclass
class ModelRunnerOutput:
    """What a step returned. `req_ids` are the requests that sampled, in batch order."""

    req_ids: list[str] = field(default_factory=list)
    # Per request: the tokens sampled, one per sampled row. With speculative rows the worker's
    # rejection sampler has already cut them to the accepted drafts plus one bonus/correction token.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # per sampled token
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Speculative decoding: drafts proposed for each request's next step (the scheduler verifies them then).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_parents: dict[str, list[int]] = field(default_factory=dict)  # the drafts that are trees: their parents
    # Embedding requests whose prompt ended in this step: the pooled final hidden state (float32 values), by id.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    timings: StepTimings = field(default_factory=StepTimings)

    def merge(self, other: "ModelRunnerOutput") -> None:
        """Append another step's results (requests run apart after a failed step)."""
        self.req_ids += other.req_ids
        self.sampled_token_ids += other.sampled_token_ids
        self.logprobs.update(other.logprobs)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.spec_token_ids.update(other.spec_token_ids)
        self.spec_parents.update(other.spec_parents)
        self.pooled.update(other.pooled)
        for name, value in vars(other.timings).items():  # every StepTimings field, by name: each one adds up
            setattr(self.timings, name, getattr(self.timings, name) + value)
