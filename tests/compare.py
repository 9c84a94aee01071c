"""Comparing two generate() runs in tests: the same tokens, and logprobs within a tolerance."""
from __future__ import annotations

import pytest


def assert_same_outputs(a, b, label: str, atol: float = 1e-4) -> None:
    """a, b: CompletionOutputs of the same prompts. Token ids equal (the first divergence is named) and every
    logprob both runs report within `atol`."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x.token_ids != y.token_ids:
            step = next(k for k, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t)
            pytest.fail(f"{label}: prompt {i} diverges at step {step}")
        for step, (ex, ey) in enumerate(zip(x.logprobs, y.logprobs)):
            for tid, lp in ex.items():
                if tid in ey:
                    assert abs(lp.logprob - ey[tid].logprob) < atol, \
                        f"{label}: prompt {i} step {step} token {tid}: {lp.logprob} vs {ey[tid].logprob}"


def greedy_with_logprobs(llm, prompts: list[list[int]], sp) -> list[tuple[list[int], list[float]]]:
    """Each prompt's (token ids, chosen tokens' logprobs), `sp` asking for logprobs=0."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]
