"""Bad input fails early with an error that names what is wrong, and leaves the engine usable."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

MAX_LEN = 64


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The model is tiny: one intra-op thread is as fast, and does not stall when the CPUs are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("errors") / "llama", "llama")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=32)


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.groups
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_invariants()


def raises(exc, *words):
    """pytest.raises that also checks every word appears in the message."""

    class _Check:
        def __enter__(self):
            self._cm = pytest.raises(exc)
            self.info = self._cm.__enter__()
            return self.info

        def __exit__(self, *a):
            suppressed = self._cm.__exit__(*a)
            msg = str(self.info.value)
            for w in words:
                assert w in msg, f"{w!r} not in error message {msg!r}"
            return suppressed

    return _Check()


# ---- sampling parameters -----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(n=0), "n"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(top_k=2**63), "top_k"),
    (dict(seed=2**64), "seed"),
    (dict(n=2**63), "n"),
    (dict(max_tokens=10**30), "max_tokens"),
    (dict(logprobs=2**70), "logprobs"),
    (dict(n=2.0), "n"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(logit_bias={5: float("inf")}), "logit_bias"),
    (dict(logit_bias={"five": 1.0}), "logit_bias"),
    (dict(stop_token_ids=["2"]), "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, name):
    with raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).split()[0] == name, str(e.value)


def test_edge_sampling_params_are_accepted():
    # The boundaries themselves are valid.
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, n=1, presence_penalty=2.0,
                   frequency_penalty=-2.0, repetition_penalty=1e-3, min_tokens=1, logprobs=0, prompt_logprobs=0)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


@pytest.mark.parametrize("kwargs, words", [
    (dict(stop_token_ids=[10**6]), ("stop_token_ids", "1000000")),
    (dict(logit_bias={-1: 1.0}), ("logit_bias", "-1")),
    (dict(min_tokens=MAX_LEN + 1, max_tokens=None), ("min_tokens", str(MAX_LEN))),
])
def test_params_checked_against_the_model_at_admission(llm, kwargs, words):
    with raises(ValueError, *words):
        llm.generate([[7, 8, 9]], SamplingParams(**kwargs), use_tqdm=False)
    assert_idle(llm)


def test_extreme_but_valid_values_run_beside_others(llm):
    """Values at the edge of int64 are admitted and normalised (top_k beyond the vocabulary is no top-k; seeds
    wrap modulo 2**63), and never fail the batch they share."""
    prompts = [[7, 8, 9, 10], [11, 12, 13]]
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    extreme = SamplingParams(temperature=0.7, max_tokens=5, top_k=2**63 - 1, seed=-(2**63), n=2,
                             logit_bias={3: 100.0, 4: -100.0}, stop_token_ids=[llm.engine.vocab_size - 1],
                             ignore_eos=True)
    outs = llm.generate([prompts[0], [5, 6], prompts[1]], [greedy, extreme, greedy], use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected
    assert [len(c.token_ids) for c in outs[1].outputs] == [5, 5]
    assert_idle(llm)


def test_logprobs_beyond_vocab(llm):
    V = llm.engine.vocab_size
    with raises(ValueError, "logprobs", str(V)):
        llm.generate(["hello"], SamplingParams(max_tokens=2, logprobs=V + 1), use_tqdm=False)
    with raises(ValueError, "prompt_logprobs", str(V)):
        llm.generate(["hello"], SamplingParams(max_tokens=2, prompt_logprobs=V + 1), use_tqdm=False)
    assert_idle(llm)
    # The whole vocabulary is allowed.
    out = llm.generate(["hello"], SamplingParams(max_tokens=1, logprobs=V, prompt_logprobs=V), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == V
    assert all(len(e) == V for e in out.prompt_logprobs[1:])


# ---- prompts -----------------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len(llm):
    for n in (MAX_LEN, MAX_LEN + 10):  # equal leaves no room for a generated token
        with raises(ValueError, "max_model_len", str(MAX_LEN), str(n)):
            llm.generate([[5] * n], SamplingParams(max_tokens=1), use_tqdm=False)
    with raises(ValueError, "max_model_len"):
        llm.generate(["The quick brown fox jumps over the lazy dog. " * 20], use_tqdm=False)
    # One token shorter fits, and max_tokens is clipped to the room left.
    out = llm.generate([[5] * (MAX_LEN - 1)], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_empty_prompts(llm):
    with raises(ValueError, "prompt", "empty"):
        llm.generate("", use_tqdm=False)
    with raises(ValueError, "prompt", "empty"):
        llm.generate([[]], use_tqdm=False)
    with raises(ValueError, "prompt", "empty"):
        llm.engine.add_request("empty-ids", [])
    with raises(ValueError, "prompt"):
        llm.engine.add_request("none", None)
    assert_idle(llm)


def test_token_ids_outside_vocabulary(llm):
    V = llm.engine.vocab_size
    with raises(ValueError, "vocabulary", str(V)):
        llm.generate([[1, 2, V]], use_tqdm=False)
    with raises(ValueError, "vocabulary", "-1"):
        llm.generate([[1, -1, 2]], use_tqdm=False)
    assert_idle(llm)
    assert llm.generate([[1, 2, V - 1]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_duplicate_request_id(llm):
    llm.engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    with raises(ValueError, "dup"):
        llm.engine.add_request("dup", [4, 5, 6], SamplingParams(max_tokens=2))
    llm.engine.abort_request("dup")
    assert_idle(llm)


def test_mismatched_lists(llm):
    with raises(ValueError, "2 prompts", "3 sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    with raises(ValueError, "2 prompts", "1 priorities"):
        llm.generate(["a", "b"], use_tqdm=False, priority=[1])
    assert_idle(llm)


# ---- recovery ----------------------------------------------------------------------------------
def test_engine_recovers_after_a_bad_prompt_in_a_batch(llm):
    good = [[7, 8, 9, 10], [11, 12, 13]]
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    expected = [o.outputs[0].token_ids for o in llm.generate(good, sp, use_tqdm=False)]
    for bad in ([1] * (MAX_LEN + 1), [llm.engine.vocab_size + 3], []):
        with pytest.raises(ValueError):
            llm.generate([good[0], bad, good[1]], sp, use_tqdm=False)
        assert_idle(llm)  # the good prompts admitted before the bad one were withdrawn
        assert [o.outputs[0].token_ids for o in llm.generate(good, sp, use_tqdm=False)] == expected


def test_a_transient_step_failure_is_retried(llm, monkeypatch):
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    prompts = [[7, 8, 9, 10], [11, 12, 13]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    runner = llm.engine.runner
    real = runner.execute_model
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real(batch)

    monkeypatch.setattr(runner, "execute_model", flaky)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert calls["n"] > 3
    assert [o.outputs[0].token_ids for o in outs] == expected  # each request ran again alone, unchanged
    assert_idle(llm)


POISON_SEED = 666


def poisoned(real):
    """execute_model that fails whenever the batch holds a request seeded POISON_SEED (as a per-request
    value that breaks tensor building would), after the other requests were added."""

    def run(batch):
        if any(new.params.seed == POISON_SEED for new in batch.new_requests):
            raise OverflowError("simulated: a value that does not fit a tensor")
        return real(batch)

    return run


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_a_request_that_fails_the_step_fails_alone(llm, monkeypatch, shared_prefix):
    """The failing request ends with an error; the others in its step finish as if it had never been there,
    including one admitted in the same step that shares prefix blocks the failing one was to compute."""
    prompt = list(range(5, 45))  # 40 tokens: two full blocks to share
    good = SamplingParams(temperature=0.0, max_tokens=6)
    others = [prompt if shared_prefix else [7, 8, 9, 10], [11, 12, 13]]
    expected = [o.outputs[0].token_ids for o in llm.generate(others, good, use_tqdm=False)]
    llm.engine.core.reset_prefix_cache()
    monkeypatch.setattr(llm.engine.runner, "execute_model", poisoned(llm.engine.runner.execute_model))
    bad = SamplingParams(temperature=0.0, max_tokens=6, seed=POISON_SEED)
    preemptions = llm.engine.scheduler.num_preemptions
    outs = llm.generate([prompt, *others], [bad, good, good], use_tqdm=False)
    # Sharing the failed request's uncomputed blocks sent the second back to the queue to recompute them.
    assert llm.engine.scheduler.num_preemptions - preemptions == int(shared_prefix)
    failed = outs[0].outputs[0]
    assert failed.finish_reason == "abort" and "failed in the engine" in str(failed.stop_reason)
    assert [o.outputs[0].token_ids for o in outs[1:]] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs[1:])
    assert_idle(llm)


# ---- engine configuration ----------------------------------------------------------------------
def test_bad_dtype(path):
    with raises(ValueError, "dtype", "float8"):
        LLM(str(path), dtype="float8", max_model_len=MAX_LEN, num_gpu_blocks_override=8)


def test_max_model_len_beyond_the_model(path):
    max_pos = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    with raises(ValueError, "max_model_len", "max_position_embeddings", str(max_pos), str(max_pos + 1)):
        LLM(str(path), max_model_len=max_pos + 1, num_gpu_blocks_override=64)
    with raises(ValueError, "max_model_len"):
        LLM(str(path), max_model_len=0, num_gpu_blocks_override=8)
    assert LLM(str(path), max_model_len=max_pos, num_gpu_blocks_override=max_pos // 16).engine.max_model_len == max_pos


@pytest.mark.parametrize("kwargs, name", [
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(scheduling_policy="lifo"), "policy"),
])
def test_bad_engine_options(path, kwargs, name):
    with raises(ValueError, name):
        LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=8, **kwargs)


# ---- model folders -----------------------------------------------------------------------------
def edited_copy(path, dst, **changes):
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unknown_architecture(path, tmp_path):
    bad = edited_copy(path, tmp_path / "foo", architectures=["FooForCausalLM"])
    with raises(ValueError, "FooForCausalLM", "LlamaForCausalLM"):  # names it, and what is supported
        LLM(str(bad), max_model_len=MAX_LEN, num_gpu_blocks_override=8)


def test_unknown_model_type(path, tmp_path):
    bad = edited_copy(path, tmp_path / "foo_type", model_type="foo_bar_model")
    with raises(ValueError, "foo_bar_model"):
        LLM(str(bad), max_model_len=MAX_LEN, num_gpu_blocks_override=8)


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                    "lm_head.weight"])
def test_missing_weight_tensor(path, tmp_path, tensor):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "missing"
    shutil.copytree(path, bad)
    weights = load_file(str(bad / "model.safetensors"))
    assert tensor in weights
    del weights[tensor]
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with raises(ValueError, "missing", tensor.removeprefix("model.")):
        LLM(str(bad), max_model_len=MAX_LEN, num_gpu_blocks_override=8)


def test_wrong_weight_shape(path, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "shape"
    shutil.copytree(path, bad)
    weights = load_file(str(bad / "model.safetensors"))
    name = "model.norm.weight"
    weights[name] = torch.ones(weights[name].shape[0] + 1)
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with raises(ValueError, "norm.weight", "shape"):
        LLM(str(bad), max_model_len=MAX_LEN, num_gpu_blocks_override=8)


def test_missing_files(path, tmp_path):
    with raises(FileNotFoundError, "does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    no_config = tmp_path / "no-config"
    shutil.copytree(path, no_config)
    (no_config / "config.json").unlink()
    with raises(FileNotFoundError, "config.json"):
        LLM(str(no_config), max_model_len=MAX_LEN, num_gpu_blocks_override=8)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(path, no_weights)
    (no_weights / "model.safetensors").unlink()
    with raises(FileNotFoundError, "safetensors"):
        LLM(str(no_weights), max_model_len=MAX_LEN, num_gpu_blocks_override=8)
    # An index naming a shard that is not there.
    bad_index = tmp_path / "bad-index"
    shutil.copytree(path, bad_index)
    (bad_index / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with raises(FileNotFoundError, "model-00002-of-00002.safetensors"):
        LLM(str(bad_index), max_model_len=MAX_LEN, num_gpu_blocks_override=8)
