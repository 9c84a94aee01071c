"""Per-step host cost of the worker's input batch: InputBatch.update (apply the step's diffs) + prepare (the
step's tensors), without a model. Prints µs per step for each scenario:

- decode at batch 1, 16 and 64 (contexts of ~1000 tokens, one new token per request per step, a new block
  every block_size tokens);
- decode at batch 16 verifying 4 drafts per request;
- a 2048-token prompt arriving whole (a new request) and a 2048-token chunk of a long prompt (a request
  the worker already holds).

    python benchmarks/input_batch.py                 # all scenarios, best of 5 rounds
    python benchmarks/input_batch.py --rounds 9 --steps 400

The batches are built before the clock starts (that is the core's cost, not the worker's); each round
starts from a fresh InputBatch, and a round's figure is the median step, the best round counts (the
machine is shared: the load average is printed with each line).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenmill.core.batch import CachedRequestData, NewRequestData, ScheduledBatch  # noqa: E402
from tokenmill.executor.input_batch import InputBatch  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

BLOCK = 16
VOCAB = 32000


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return "/".join(f.read().split()[:3])
    except OSError:
        return "?"


def decode_steps(batch: int, steps: int, context: int = 1000, drafts: int = 0) -> list[ScheduledBatch]:
    """The first batch admits `batch` requests (prompt fully cached but its last token); each later step
    schedules every request for one token plus `drafts` drafts, and all drafts are rejected (the worst case
    for the table: the tokens only grow by one)."""
    rng = random.Random(0)
    next_block = 0
    out = []
    first = ScheduledBatch()
    state = {}  # rid -> (tokens, blocks)
    for i in range(batch):
        rid = f"r{i}"
        tokens = [rng.randrange(VOCAB) for _ in range(context)]
        n_blocks = -(-(context + drafts) // BLOCK)
        blocks = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        state[rid] = (tokens, blocks)
        first.req_ids.append(rid)
        first.num_scheduled_tokens.append(1)
        first.num_sample_rows.append(1)
        first.new_requests.append(NewRequestData(rid, list(tokens), context, list(blocks), context - 1,
                                                 SamplingParams(), None))
    out.append(first)
    for _ in range(steps):
        b = ScheduledBatch()
        for rid, (tokens, blocks) in state.items():
            tokens.append(rng.randrange(VOCAB))
            computed = len(tokens) - 1
            need = -(-(len(tokens) + drafts) // BLOCK)
            new_blocks = []
            while len(blocks) < need:
                blocks.append(next_block)
                new_blocks.append(next_block)
                next_block += 1
            b.req_ids.append(rid)
            b.num_scheduled_tokens.append(1 + drafts)
            b.num_sample_rows.append(1 + drafts)
            if drafts:
                b.spec_token_ids[rid] = [rng.randrange(VOCAB) for _ in range(drafts)]
            b.cached_requests.append(CachedRequestData(rid, tokens[-1:], new_blocks, computed, len(blocks)))
        out.append(b)
    return out


def prompt_steps(steps: int, chunk: int = 2048, whole: bool = True) -> list[ScheduledBatch]:
    """whole: each step admits a fresh request with a `chunk`-token prompt (and forgets the last one).
    Else one request with a long prompt computed `chunk` tokens per step (its blocks arrive as it goes)."""
    rng = random.Random(0)
    prompt_len = chunk if whole else chunk * (steps + 1)
    tokens = [rng.randrange(VOCAB) for _ in range(prompt_len)]
    out = []
    if whole:
        blocks = list(range(chunk // BLOCK))
        for s in range(steps + 1):
            rid = f"p{s}"
            out.append(ScheduledBatch(
                req_ids=[rid], num_scheduled_tokens=[chunk], num_sample_rows=[1],
                new_requests=[NewRequestData(rid, list(tokens), chunk, list(blocks), 0, SamplingParams(), None)],
                finished_req_ids=[f"p{s - 1}"] if s else []))
        return out
    per = chunk // BLOCK
    out.append(ScheduledBatch(req_ids=["p"], num_scheduled_tokens=[chunk], num_sample_rows=[0], new_requests=[
        NewRequestData("p", list(tokens), prompt_len, list(range(per)), 0, SamplingParams(), None)]))
    for s in range(1, steps + 1):
        out.append(ScheduledBatch(req_ids=["p"], num_scheduled_tokens=[chunk], num_sample_rows=[0], cached_requests=[
            CachedRequestData("p", [], list(range(s * per, (s + 1) * per)), s * chunk, (s + 1) * per)]))
    return out


def run(batches: list[ScheduledBatch], rounds: int) -> float:
    """Best round's median µs of update + prepare over every step but the first (the admission)."""
    best = float("inf")
    for _ in range(rounds):
        ib = InputBatch(BLOCK, torch.device("cpu"), VOCAB)
        ib.update(batches[0])
        ib.prepare(batches[0])
        times = []
        for b in batches[1:]:
            t0 = time.perf_counter_ns()
            ib.update(b)
            ib.prepare(b)
            times.append(time.perf_counter_ns() - t0)
        best = min(best, statistics.median(times) / 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    scenarios = [
        ("decode B=1", decode_steps(1, args.steps)),
        ("decode B=16", decode_steps(16, args.steps)),
        ("decode B=64", decode_steps(64, args.steps)),
        ("decode B=16, 4 drafts", decode_steps(16, args.steps, drafts=4)),
        ("prompt 2048 (new request)", prompt_steps(min(args.steps, 50), whole=True)),
        ("prompt chunk 2048 (held request)", prompt_steps(min(args.steps, 15), whole=False)),
    ]
    for name, batches in scenarios:
        us = run(batches, args.rounds)
        print(f"{name:34s} {us:9.1f} µs/step   [load {loadavg()}]", flush=True)


if __name__ == "__main__":
    main()
