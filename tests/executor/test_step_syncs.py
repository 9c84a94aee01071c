"""Device syncs per step (issue 31): how many times a step copies device results to the host, each a stall on a
GPU. On this CPU-only machine the device is emulated: the model's hidden states come back as a tensor subclass,
so everything computed from them (logits, sampling, verification, drafts) is that subclass too while the host's
own bookkeeping stays plain, and every call that would copy a device tensor to the host is counted (`.cpu()`,
`.tolist()`, `.item()`, `bool()`, `int()`, `float()`; `.numpy()` of a device tensor raises instead). What the
host uploads through host_upload.Uploader (the step's inputs, the sampling tensors) comes back tagged too, so a
read of those is counted as well (draws.row_uniforms used to test the uploaded draw keys for "all seeded")."""
from __future__ import annotations

import collections

import pytest
import torch

from test_speculative import KV
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

TRANSFERS = {"cpu", "tolist", "item", "__bool__", "__int__", "__float__", "__index__"}
PROMPTS = ["hello hello hello hello", "the cat the cat the cat"]


class OnDevice(torch.Tensor):
    """A tensor standing for one on the accelerator: counts the calls that would copy it to the host."""

    copies: collections.Counter = collections.Counter()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in TRANSFERS:
            cls.copies[name] += 1
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) if name == "cpu" else out  # its copy is on the host


def copies_per_step(llm, params, prompt_logprobs: list | None = None) -> list[tuple[int, int]]:
    """(rows sampled, host copies) of every step of generating PROMPTS; `prompt_logprobs` collects whether each
    step computed prompt logprobs."""
    runner = llm.engine.core.executor.worker.runner
    forward = runner.model.forward
    runner.model.forward = lambda *a, **k: forward(*a, **k).as_subclass(OnDevice)
    uploader = runner.input_batch.uploader  # (the sampling state's too)
    assert runner.input_batch.sampling.uploader is uploader
    upload = uploader.upload
    uploader.upload = lambda a: upload(a).as_subclass(OnDevice)
    draft = runner.spec.runner if runner.spec is not None else None
    if draft is not None and not draft.head:  # a draft model reads tokens only: its outputs are on the device too
        draft_forward = draft.module.forward
        draft.module.forward = lambda *a, **k: draft_forward(*a, **k).as_subclass(OnDevice)
    execute, steps = runner.execute_model, []

    def counted(batch):
        OnDevice.copies.clear()
        out = execute(batch)
        steps.append((sum(batch.num_sample_rows), sum(OnDevice.copies.values())))
        if prompt_logprobs is not None:
            prompt_logprobs.append(bool(batch.prompt_logprob_ranges))
        return out

    runner.execute_model = counted
    llm.generate(PROMPTS, params, use_tqdm=False)
    return steps


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=2)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, temperature=0, logprobs=3),
                                    SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=4)],
                         ids=["greedy+logprobs", "seeded-top-p"])
def test_a_step_copies_its_results_to_the_host_once(target, params):
    """Prompt chunks that sample nothing copy nothing; every other step copies once (tokens and logprobs packed)."""
    llm = LLM(str(target), attention_backend="torch_sdpa", max_num_batched_tokens=8, block_size=4, **KV)
    steps = copies_per_step(llm, params)
    assert any(rows == 0 for rows, _ in steps)  # chunked prompts: steps that sample nothing
    assert all(copies == (1 if rows else 0) for rows, copies in steps), steps


def test_prompt_logprobs_of_every_request_come_back_in_one_copy(target):
    """A step with prompt logprobs adds one copy, whatever the number of requests asking (four per request before)."""
    llm = LLM(str(target), attention_backend="torch_sdpa", max_num_batched_tokens=8, block_size=4, **KV)
    with_prompt: list[bool] = []
    steps = copies_per_step(llm, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3), with_prompt)
    assert sum(with_prompt) >= 2
    assert all(copies == (1 if rows else 0) + p for (rows, copies), p in zip(steps, with_prompt)), steps


@pytest.mark.parametrize("method", ["dflash", "medusa", "medusa_tree", "eagle", "draft_model"])
def test_a_drafting_step_copies_its_results_and_its_drafts_once_each(target, tmp_path, method):
    """Speculation: the verification's tokens, logprobs and accepted counts in one copy, the next drafts in
    another (a block and its cut; Medusa's candidates; every pass of an EAGLE head or a draft model, each pass fed
    the last one's drafts on the device): the drafts must reach the host, where the scheduler places them. A tree's
    accepted paths come back with the tokens; its K/V moves after. (EAGLE-2 trees copy once per level: not yet,
    docs/gpu.md.)"""
    from draft_heads_tiny import write_eagle_head
    from medusa_tiny import write_medusa
    from test_dflash import write_drafter

    spec = {"dflash": {"method": "dflash", "model": str(write_drafter(tmp_path / "d", target)), "block_threshold": 0.3},
            "medusa": {"method": "medusa", "model": str(write_medusa(tmp_path / "m", target)),
                       "num_speculative_tokens": 3, "medusa_choices": [[0], [0, 0], [0, 0, 0]]},
            "medusa_tree": {"method": "medusa", "model": str(write_medusa(tmp_path / "m", target)),
                            "num_speculative_tokens": 4, "medusa_choices": [[0], [1], [0, 0], [1, 0]]},
            "eagle": {"method": "eagle", "model": str(write_eagle_head(tmp_path / "e", target, copy=False)),
                      "num_speculative_tokens": 3},
            "draft_model": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}}[method]
    spec["adaptive"] = False
    llm = LLM(str(target), attention_backend="torch_sdpa", speculative_config=spec, **KV)
    steps = copies_per_step(llm, SamplingParams(max_tokens=12, temperature=0, logprobs=2))
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    assert all(copies == 2 for _, copies in steps), steps
