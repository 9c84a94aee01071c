"""tokenmill bench datasets: deterministic for a seed, lengths as asked, files of every shape."""
import json
from collections import Counter

import pytest

from tokenmill.bench.datasets import DatasetSpec, build_dataset, encode


def spec(**kw):
    return DatasetSpec(**kw)


def test_random_is_deterministic_per_seed():
    a = build_dataset(spec(name="random", num_prompts=5, random_input_len=20, seed=1))
    b = build_dataset(spec(name="random", num_prompts=5, random_input_len=20, seed=1))
    c = build_dataset(spec(name="random", num_prompts=5, random_input_len=20, seed=2))
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert len({r.prompt for r in a}) == 5


def test_random_lengths_follow_range_ratio_without_tokenizer():
    reqs = build_dataset(spec(name="random", num_prompts=200, random_input_len=100, random_output_len=40,
                              random_range_ratio=0.5))
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert all(len(r.prompt.split()) == r.prompt_len for r in reqs)  # words stand in for tokens
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 20
    assert min(outs) >= 20 and max(outs) <= 60
    fixed = build_dataset(spec(name="random", num_prompts=10, random_input_len=30, random_output_len=7))
    assert {r.prompt_len for r in fixed} == {30} and {r.output_len for r in fixed} == {7}
    assert not fixed[0].exact and fixed[0].messages is None


def test_random_range_ratio_must_be_below_one():
    with pytest.raises(ValueError):
        build_dataset(spec(name="random", num_prompts=1, random_range_ratio=1.0))


def test_exact_token_lengths_with_a_tokenizer(tiny_tokenizer):
    reqs = build_dataset(spec(name="random", num_prompts=30, random_input_len=64, random_range_ratio=0.5),
                         tiny_tokenizer)
    for r in reqs:
        assert r.exact and len(encode(tiny_tokenizer, r.prompt)) == r.prompt_len
        assert 32 <= r.prompt_len <= 96
    for name, flag in (("long-context", "long_context_input_len"), ("long-decode", "long_decode_input_len")):
        reqs = build_dataset(spec(name=name, num_prompts=2, **{flag: 300}), tiny_tokenizer)
        assert [len(encode(tiny_tokenizer, r.prompt)) for r in reqs] == [300, 300]


def test_shared_prefix_shares_few_system_prompts():
    reqs = build_dataset(spec(name="shared-prefix", num_prompts=20, shared_prefix_num_prefixes=3,
                              shared_prefix_prefix_len=50, shared_prefix_suffix_len=8, shared_prefix_output_len=9))
    systems = Counter(r.messages[0]["content"] for r in reqs)
    assert sorted(systems.values()) == [6, 7, 7]
    assert all(len(s.split()) == 50 for s in systems)
    questions = [r.messages[1]["content"] for r in reqs]
    assert len(set(questions)) == 20 and all(len(q.split()) == 8 for q in questions)
    assert all(r.prompt == f"{r.messages[0]['content']}\n\n{r.messages[1]['content']}" for r in reqs)
    assert all(r.output_len == 9 and r.prompt_len == 58 for r in reqs)
    assert len({r.messages[0]["content"] for r in reqs[:6]}) > 1  # shuffled: prefixes interleave
    again = build_dataset(spec(name="shared-prefix", num_prompts=20, shared_prefix_num_prefixes=3,
                               shared_prefix_prefix_len=50, shared_prefix_suffix_len=8))
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_long_datasets_defaults():
    ctx = build_dataset(spec(name="long-context"))
    dec = build_dataset(spec(name="long-decode"))
    assert len(ctx) == 4 and ctx[0].prompt_len == 7168 and ctx[0].output_len == 128
    assert len(dec) == 8 and dec[0].prompt_len == 64 and dec[0].output_len == 4096


def test_file_dataset_shapes(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "hello there", "max_tokens": 12},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"conversations": [{"from": "system", "value": "x"}, {"from": "human", "value": "what is up"},
                           {"from": "gpt", "value": "not much at all"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"other": 1},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = build_dataset(spec(name="file", dataset_path=str(path)))
    assert len(reqs) == 3
    assert (reqs[0].prompt, reqs[0].output_len, reqs[0].prompt_len) == ("hello there", 12, 2)
    assert reqs[1].messages[1]["content"] == "hi" and reqs[1].prompt is None and reqs[1].output_len == 256
    assert reqs[2].prompt == "what is up" and reqs[2].output_len == 4  # the gpt reply's length (words)
    cycled = build_dataset(spec(name="file", dataset_path=str(path), num_prompts=7, file_output_len=5))
    assert [r.prompt for r in cycled][3] == "hello there" and {r.output_len for r in cycled} == {5}


def test_file_dataset_sharegpt_json_array_and_errors(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "q1"}]},
                                {"id": "b", "conversations": [{"from": "human", "value": "q2"}]}]))
    assert [r.prompt for r in build_dataset(spec(name="file", dataset_path=str(path)))] == ["q1", "q2"]
    with pytest.raises(ValueError, match="dataset-path"):
        build_dataset(spec(name="file"))
    with pytest.raises(FileNotFoundError):
        build_dataset(spec(name="file", dataset_path=str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        build_dataset(spec(name="file", dataset_path=str(bad)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="no entry"):
        build_dataset(spec(name="file", dataset_path=str(empty)))


def test_unknown_dataset():
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset(spec(name="nope"))
