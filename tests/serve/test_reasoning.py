"""Reasoning parsers (deepseek_r1, qwen3): whole outputs, and streams that split exactly at the tags
however the text is cut."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tokenmill.serve.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    get_reasoning_parser,
)

SETTINGS = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stream(parser, chunks: list[str]) -> tuple[str, str]:
    parts = [parser.feed(c) for c in chunks] + [parser.flush()]
    for r, c in parts:
        assert r != "" and c != ""
    return "".join(r or "" for r, _ in parts), "".join(c or "" for _, c in parts)


def cut(text: str, points: list[int]) -> list[str]:
    points = sorted(set(p for p in points if 0 < p < len(text)))
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


@pytest.mark.parametrize("text,want", [
    ("<think>\nhmm, 2+2\n</think>\n\nIt is 4.", ("\nhmm, 2+2\n", "It is 4.")),
    ("hmm</think>\n\nIt is 4.", ("hmm", "It is 4.")),  # the template opened <think>
    ("<think>still thinking", ("still thinking", None)),
    ("no tags at all", ("no tags at all", None)),
    ("<think></think>\n\nAnswer", (None, "Answer")),
    ("a</think>b</think>c", ("a", "b</think>c")),
    ("a</think>\n\n", ("a", None)),
    ("", (None, None)),
])
def test_deepseek_r1_extract(text, want):
    assert DeepSeekR1ReasoningParser().extract(text) == want
    assert stream(DeepSeekR1ReasoningParser(), list(text)) == tuple(x or "" for x in want)


@pytest.mark.parametrize("text,want", [
    ("<think>\nhmm\n</think>\n\nIt is 4.", ("\nhmm\n", "It is 4.")),
    ("hmm</think>It is 4.", ("hmm", "It is 4.")),
    ("<think>still thinking", (None, "<think>still thinking")),
    ("Just an answer.", (None, "Just an answer.")),
])
def test_qwen3_extract(text, want):
    assert Qwen3ReasoningParser().extract(text) == want


def test_qwen3_stream_decides_at_the_start():
    assert stream(Qwen3ReasoningParser(), ["<thi", "nk>a</th", "ink>\n", "\nb"]) == ("a", "b")
    assert stream(Qwen3ReasoningParser(), ["<thi", "s is content"]) == ("", "<this is content")
    # The documented differences from extract: a stream cannot wait for </think>.
    assert stream(Qwen3ReasoningParser(), ["<think>trunc", "ated"]) == ("truncated", "")
    assert stream(Qwen3ReasoningParser(), ["a</think>b"]) == ("", "a</think>b")


def test_stream_holds_back_a_split_tag():
    p = DeepSeekR1ReasoningParser()
    assert p.feed("<th") == (None, None)
    assert p.feed("ink>abc</th") == ("abc", None)
    assert p.feed("ing") == ("</thing", None)
    assert p.feed("</think>") == (None, None)
    assert p.feed("\n\n") == (None, None)
    assert p.feed("\nHi") == (None, "Hi")
    assert p.feed("\n") == (None, "\n")
    assert p.flush() == (None, None)


@pytest.mark.parametrize("cls", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser])
def test_reasoning_ended_in_prompt(cls):
    p = cls()
    assert p.ended_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not p.ended_in_prompt("<|im_start|>assistant\n<think>\n")
    assert not p.ended_in_prompt("<|im_start|>assistant\n")
    assert not p.ended_in_prompt("</think> earlier turn <think>\n")
    text = "\nAnswer </think> with <think> tags"
    ended = cls(reasoning_ended=True)
    assert ended.extract(text) == (None, text)
    assert stream(ended, list(text)) == ("", text)


def test_end_token_ids(tiny_tokenizer):
    p = DeepSeekR1ReasoningParser(tiny_tokenizer)
    ids = p.end_token_ids()
    assert len(ids) > 1 and tiny_tokenizer.decode(ids) == "</think>"
    with pytest.raises(ValueError, match="needs a tokenizer"):
        DeepSeekR1ReasoningParser().end_token_ids()


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "openai_gptoss"}
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1, openai_gptoss, qwen3"):
        get_reasoning_parser("o1")


TOKENS = ["<think>", "</think>", "<", "/", "think", ">", "<th", "ink>", "</th", "a", "b", " ", "\n", "\r", "é"]
texts = st.lists(st.sampled_from(TOKENS), max_size=25).map("".join)


@SETTINGS
@given(text=texts, data=st.data())
def test_deepseek_any_chunking_matches_extract(text, data):
    chunks = cut(text, data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    want = DeepSeekR1ReasoningParser().extract(text)
    assert stream(DeepSeekR1ReasoningParser(), chunks) == tuple(x or "" for x in want)


@SETTINGS
@given(text=texts, data=st.data())
def test_qwen3_any_chunking_matches_extract(text, data):
    # where the stream can know what extract knows: it opens with <think> iff it closes it
    assume(text.startswith("<think>") == ("</think>" in text))
    chunks = cut(text, data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    want = Qwen3ReasoningParser().extract(text)
    assert stream(Qwen3ReasoningParser(), chunks) == tuple(x or "" for x in want)


@SETTINGS
@given(reasoning=st.text("ab <>/\n", max_size=15), content=st.text("ab <>/\n", max_size=15),
       opened=st.booleans(), closed=st.booleans())
def test_deepseek_ground_truth(reasoning, content, opened, closed):
    assume("<think>" not in reasoning + content and "</think>" not in reasoning + content)
    text = ("<think>" if opened else "") + reasoning + ("</think>" + content if closed else "")
    want = (reasoning or None, (content.lstrip("\n") or None) if closed else None)
    assert DeepSeekR1ReasoningParser().extract(text) == want


# Qwen3-style: the generation prompt opens nothing unless thinking is off (then an empty think block).
QWEN3_LIKE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")


@pytest.mark.parametrize("cls", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser])
def test_think_blocks_of_earlier_turns_do_not_end_this_turns_reasoning(cls, tiny_tokenizer):
    """issue 25: a multi-turn reasoning conversation (earlier assistant turns hold think blocks) turned the
    parsers off; only what the template appends to open this turn counts."""
    import asyncio
    from types import SimpleNamespace

    from tokenmill.serve.chat import render_chat
    from tokenmill.serve.chat_completions import generation_prompt
    from tokenmill.serve.protocol import ChatCompletionRequest

    async def run_blocking(fn, *args, size=0):
        return fn(*args)

    state = SimpleNamespace(run_blocking=run_blocking, engine=SimpleNamespace(tokenizer=tiny_tokenizer),
                            settings=SimpleNamespace(chat_template=QWEN3_LIKE))
    messages = [{"role": "user", "content": "What is 5 plus 5?"},
                {"role": "assistant", "content": "<think>5 plus 5 equals 10.</think>The answer is 10."},
                {"role": "user", "content": "And 6 plus 6?"}]

    def ended(**kw) -> bool:
        req = ChatCompletionRequest(model="m", messages=messages, **kw)
        text = render_chat(tiny_tokenizer, req.messages, QWEN3_LIKE, True, False, None,
                           req.chat_template_kwargs)
        assert cls().ended_in_prompt(text) == ("</think>" in text)  # the whole prompt: the old, wrong answer
        return cls().ended_in_prompt(asyncio.run(generation_prompt(state, req, text)))

    assert not ended()
    assert ended(chat_template_kwargs={"enable_thinking": False})
