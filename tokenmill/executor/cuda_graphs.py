"""CUDA graphs for decode steps: the model's forward captured once per padded batch size, then replayed.

A decode step of a small model is launch-bound on a GPU: hundreds of small kernels, each a few µs of Python and
driver time. A CUDA graph records a forward's kernels once and replays them with one launch. Replay repeats the
same kernels on the same addresses with the same host-side values, so everything a step varies must live in
fixed-address device buffers the step copies into: the token ids and positions (here) and the attention
backend's metadata (its `graph_buffers`, e.g. triton_paged.TritonGraphBuffers). A batch of B decodes runs the
graph of the smallest captured size P >= B; the P - B pad rows decode in the pad block (one block past the
scheduler's pool), so they touch no request's K/V.

Uniform steps replay: every request the same q new tokens, q = 1 (decodes) or, with speculative decoding, q = k + 1
(chain verifications of k drafts); no draft tree, no prompt logprobs; each KV cache group has its buffers;
prompt chunks, verification steps and larger batches run eagerly as before. `--enforce-eager` (or
TOKENMILL_CUDA_GRAPHS=0) never captures. The logits and sampling run after the replay, eagerly, on the B real rows.

On the CPU there are no graphs; TOKENMILL_CUDA_GRAPHS=emulate runs the same machinery with `EmulatedGraph`
(replay = call the captured body again, closed over the same fixed buffers and metadata views), so the tests
check here what the graphs depend on: the padding, the pad block, the fixed buffers, and that a step reads
nothing else (a stale host value would change the tokens the tests compare with eager steps and transformers).
"""
from __future__ import annotations

import bisect
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from tokenmill.layers.attention_backends.base import GroupedMetadata

log = logging.getLogger(__name__)

GRAPHS_ENV = "TOKENMILL_CUDA_GRAPHS"  # "0": never capture (as --enforce-eager); "emulate": on the CPU, for tests
WARMUP_RUNS = 2  # eager runs before capture: lazy initialisation (Triton's compilation, cuBLAS handles) stays out


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs, and max_num_seqs itself: a batch pads to the next
    size, so above 8 requests at most 7 pad rows are computed (vLLM's choice too)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


def graph_mode(device: torch.device, enforce_eager: bool) -> str | None:
    """"cuda", "emulate" or None (eager), from the device, --enforce-eager and TOKENMILL_CUDA_GRAPHS."""
    flag = os.environ.get(GRAPHS_ENV, "").strip()
    if enforce_eager or flag == "0":
        return None
    if flag == "emulate":
        return "emulate"
    return "cuda" if torch.device(device).type == "cuda" else None


class GraphBuffers(Protocol):
    """What an attention backend's `graph_buffers` returns (triton_paged.TritonGraphBuffers)."""

    max_batch: int
    max_blocks: int

    def view(self, size: int, q: int) -> Any: ...

    def fill(self, layout: Any, size: int) -> None: ...


class Replay(Protocol):
    def replay(self) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class CudaGraph:
    """One forward captured on the current CUDA stream's device, into the memory pool all sizes share (captured
    largest first, so the smaller ones reuse its blocks)."""

    def __init__(self, body: Callable[[], tuple], pool: Any) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = body()

    def replay(self) -> tuple:
        self.graph.replay()
        return self.out


class EmulatedGraph:
    """The CPU stand-in: the captured body runs again at each replay (see the module docstring). Captured by one
    run (no warm-up runs: nothing to initialise lazily on the CPU that a replay could miss)."""

    def __init__(self, body: Callable[[], tuple]) -> None:
        self.body = body
        self.out = body()

    def replay(self) -> tuple:
        self.out = self.body()
        return self.out


@dataclass
class GraphStats:
    replays: int = 0  # steps replayed
    padded_rows: int = 0  # pad requests computed over those steps
    by_size: dict[int, int] = field(default_factory=dict)  # replays per size
    by_query_len: dict[int, int] = field(default_factory=dict)  # replays per tokens per request


class DecodeGraphs:
    """The captured forwards and the fixed buffers they read. `key_for` says which graph takes a step's inputs
    (StepInputs; None: the step runs eagerly), `run` replays it and returns the hidden states [T, hidden]."""

    def __init__(self, model: torch.nn.Module, buffers: list[GraphBuffers], sizes: list[int], device: torch.device,
                 mode: str, query_lens: tuple[int, ...] = (1,)) -> None:
        self.model = model
        self.buffers = buffers  # one per KV cache group (executor/kv_groups.py): each has its own block table
        self.sizes = sizes
        self.query_lens = query_lens
        self.mode = mode
        self.max_batch = sizes[-1]
        T = self.max_batch * max(query_lens)
        self.input_ids = torch.zeros(T, dtype=torch.long, device=device)
        self.positions = torch.zeros(T, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], Replay] = {}
        self.stats = GraphStats()
        # EAGLE-3 targets: the forward also sets model.aux_hidden_states (a Python attribute a replay would not
        # set again): the graph returns it beside the hidden states and each replay sets it from there.
        self.aux = bool(model.aux_hidden_layers)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every (tokens per request, size), largest first. Until a step fills them, the buffers hold pad rows."""
        pool = torch.cuda.graph_pool_handle() if self.mode == "cuda" else None
        for q in sorted(self.query_lens, reverse=True):
            for size in reversed(self.sizes):
                # (host-side fields fixed from here on, as a graph's would be)
                meta = (self.buffers[0].view(size, q) if len(self.buffers) == 1
                        else GroupedMetadata([b.view(size, q) for b in self.buffers]))

                def body(T: int = size * q, meta: Any = meta) -> tuple[torch.Tensor, torch.Tensor | None]:
                    hidden = self.model(self.input_ids[:T], self.positions[:T], meta)
                    return hidden, (self.model.aux_hidden_states if self.aux else None)

                self.graphs[q, size] = CudaGraph(body, pool) if self.mode == "cuda" else EmulatedGraph(body)

    def key_for(self, inp: Any) -> tuple[int, int] | None:
        """(tokens per request, captured size) of the graph that takes this step, or None (eager): uniform steps
        only (every request q tokens: T == B * q with q the longest)."""
        lay = inp.layout
        B, q = lay.query_len.numel(), lay.max_query_len
        if (q not in self.query_lens or lay.num_tokens != B * q or lay.tree_req is not None or inp.prompt_rows
                or B > self.max_batch or lay.block_table.shape[1] > self.buffers[0].max_blocks):
            return None
        return q, self.sizes[bisect.bisect_left(self.sizes, B)]

    def run(self, inp: Any, key: tuple[int, int]) -> torch.Tensor:
        q, size = key
        T = inp.layout.num_tokens
        for buffers, layout in zip(self.buffers, [inp.layout, *inp.group_layouts]):
            buffers.fill(layout, size)
        self.input_ids[:T].copy_(inp.input_ids)  # (pad rows keep earlier steps' ids and positions: in range)
        self.positions[:T].copy_(inp.positions)
        hidden, aux = self.graphs[key].replay()
        if aux is not None:
            self.model.aux_hidden_states = aux[:T]
        s = self.stats
        s.replays += 1
        s.padded_rows += size - T // q
        s.by_size[size] = s.by_size.get(size, 0) + 1
        s.by_query_len[q] = s.by_query_len.get(q, 0) + 1
        return hidden[:T]
