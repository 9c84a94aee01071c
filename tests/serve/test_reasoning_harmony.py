"""gpt-oss's harmony format through the reasoning parser (openai_gptoss): the analysis channel is reasoning_content,
the final (and commentary) channel content, the markup in neither; whole outputs and streams cut anywhere agree;
a chat request served with it keeps the special tokens in its text; and through a real tokenizer whose markers are
special tokens, the detokenized output splits the same way."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.serve.reasoning import HarmonyReasoningParser, get_reasoning_parser

SETTINGS = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"


def stream(parser, chunks: list[str]) -> tuple[str, str]:
    parts = [parser.feed(c) for c in chunks] + [parser.flush()]
    for r, c in parts:
        assert r != "" and c != ""
    return "".join(r or "" for r, _ in parts), "".join(c or "" for _, c in parts)


@pytest.mark.parametrize("text,want", [
    (ANALYSIS + "User asks 2+2. Easy.<|end|>" + FINAL + "It is 4.<|return|>", ("User asks 2+2. Easy.", "It is 4.")),
    (ANALYSIS + "thinking" + "<|end|>" + FINAL + "It is 4.", ("thinking", "It is 4.")),  # <|return|> stopped on
    ("<|channel|>final<|message|>Just the answer.", (None, "Just the answer.")),
    (ANALYSIS + "still thinking", ("still thinking", None)),  # cut off in the analysis
    (ANALYSIS + "a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>" + FINAL + "c",
     ("ab", "c")),  # two analysis messages
    (ANALYSIS + "plan<|end|><|start|>assistant<|channel|>commentary to=functions.get <|constrain|>json"
     "<|message|>{\"x\": 1}<|call|>", ("plan", "{\"x\": 1}")),  # a tool call's body is content (for a tool parser)
    ("plain text, no harmony", (None, "plain text, no harmony")),
    (ANALYSIS + "<|end|>" + FINAL, (None, None)),
    ("", (None, None)),
])
def test_extract_and_stream(text, want):
    assert HarmonyReasoningParser().extract(text) == want
    assert stream(HarmonyReasoningParser(), list(text)) == tuple(x or "" for x in want)


def test_stream_holds_back_a_split_marker():
    p = HarmonyReasoningParser()
    assert p.feed("<|chan") == (None, None)
    assert p.feed("nel|>analysis<|mess") == (None, None)
    assert p.feed("age|>2+2 is<|e") == ("2+2 is", None)
    assert p.feed("asy") == ("<|easy", None)  # not a marker after all
    assert p.feed("<|end|><|start|>assistant<|channel|>final<|message|>4") == (None, "4")
    assert p.feed("<|ret") == (None, None)
    assert p.feed("urn|>") == (None, None)
    assert p.flush() == (None, None)


def test_registry_name_and_ended_in_prompt():
    assert get_reasoning_parser("openai_gptoss") is HarmonyReasoningParser
    p = HarmonyReasoningParser()
    assert not p.ended_in_prompt("<|start|>user<|message|>hi<|end|><|start|>assistant")
    # an earlier turn's final answer does not end this turn's reasoning
    assert not p.ended_in_prompt("<|start|>assistant<|channel|>final<|message|>old<|end|><|start|>assistant")
    assert p.ended_in_prompt("<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>")
    ended = HarmonyReasoningParser(reasoning_ended=True)
    text = "the answer " + ANALYSIS + "goes on"
    assert ended.extract(text) == (None, text)
    assert stream(HarmonyReasoningParser(reasoning_ended=True), list(text)) == ("", text)


PIECES = ["<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>", "<|start|>", "assistant",
          "<|return|>", "<|call|>", "<|", "|>", "a", "b", " ", "\n"]
texts = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)


@SETTINGS
@given(text=texts, data=st.data())
def test_any_chunking_matches_extract(text, data):
    points = sorted(set(p for p in data.draw(st.lists(st.integers(0, len(text)), max_size=10)) if 0 < p < len(text)))
    chunks = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    want = HarmonyReasoningParser().extract(text)
    assert stream(HarmonyReasoningParser(), chunks) == tuple(x or "" for x in want)


@SETTINGS
@given(reasoning=st.text("ab <>|/\n", max_size=15), content=st.text("ab <>|/\n", max_size=15))
def test_ground_truth(reasoning, content):
    from hypothesis import assume

    assume(not any(m in reasoning + content for m in ("<|end|>", "<|return|>", "<|call|>")))
    text = ANALYSIS + reasoning + "<|end|>" + FINAL + content + "<|return|>"
    assert HarmonyReasoningParser().extract(text) == (reasoning or None, content or None)


def harmony_tokenizer():
    """The tiny tokenizer with harmony's markers as special tokens (as o200k_harmony has them)."""
    from tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|message|>", "<|end|>", "<|start|>",
                                                          "<|return|>"]})
    return tok


def test_through_a_tokenizer_with_special_markers():
    """Detokenized with skip_special_tokens=False (what the server asks for with this parser), the markers come
    back and the split is exact; skipped, they would vanish into the text."""
    tok = harmony_tokenizer()
    text = ANALYSIS + "The user says hello.<|end|>" + FINAL + "Hello there!"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|channel|>") in ids
    kept = tok.decode(ids, skip_special_tokens=False)
    assert HarmonyReasoningParser().extract(kept) == ("The user says hello.", "Hello there!")
    pieces = [tok.decode(ids[:i + 1], skip_special_tokens=False)[len(tok.decode(ids[:i], skip_special_tokens=False)):]
              for i in range(len(ids))]
    assert stream(HarmonyReasoningParser(), pieces) == ("The user says hello.", "Hello there!")


def test_chat_request_keeps_special_tokens_with_this_parser():
    from tiny import CHATML
    from tokenmill.serve.chat_completions import prepare_chat
    from tokenmill.serve.protocol import ChatCompletionRequest
    from tokenmill.serve.sampling import Limits

    tok = harmony_tokenizer()

    async def run_blocking(fn, *args, size=0):
        return fn(*args)

    def prepared(parser: str | None):
        settings_ = SimpleNamespace(chat_template=CHATML, reasoning_parser=parser, tool_call_parser=None,
                                    enable_auto_tool_choice=False)
        state = SimpleNamespace(run_blocking=run_blocking, engine=SimpleNamespace(tokenizer=tok), settings=settings_,
                                limits=Limits(max_model_len=256, vocab_size=len(tok)))
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        return asyncio.run(prepare_chat(state, req, SimpleNamespace(take_sequences=lambda n: None)))

    assert prepared("openai_gptoss")[3].skip_special_tokens is False
    assert prepared("deepseek_r1")[3].skip_special_tokens is True
