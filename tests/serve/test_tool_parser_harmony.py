"""gpt-oss's harmony tool calls (--tool-call-parser openai with --reasoning-parser openai_gptoss): a message addressed
to `functions.NAME` becomes an OpenAI tool call (name, the body as its JSON arguments, an id) and the choice ends with
finish_reason "tool_calls"; the analysis channel is still reasoning_content and the final channel content. Whole
outputs and streams cut anywhere agree, through the parsers, the chat response and the SSE stream, and through a
tokenizer whose markers are special tokens."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.serve.chat_output import ChatPlan
from tokenmill.serve.reasoning import HarmonyReasoningParser
from tokenmill.serve.tool_parsers import HarmonyToolParser, get_tool_parser

SETTINGS = settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ANALYSIS = "<|channel|>analysis<|message|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>')
CALL_TO_FIRST = ("<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json"
                 '<|message|>{"tz": "UTC"}<|call|>')
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]


def plan() -> ChatPlan:
    return ChatPlan(tools=TOOLS, tool_choice="auto", tool_parser="openai", reasoning_parser="openai_gptoss")


def calls_of(found) -> list[tuple[str, object]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in found]


def streamed(chunks: list[str]):
    """Through ChoiceSplitter.feed/flush: (reasoning, content, [(id, name, arguments)], tools_called)."""
    s = plan().splitter()
    parts = [s.feed(c) for c in chunks] + [s.flush()]
    reasoning = "".join(p.reasoning or "" for p in parts)
    content = "".join(p.content or "" for p in parts)
    calls: list[list] = []
    for p in parts:
        assert p.reasoning != "" and p.content != ""
        for t in p.tool_calls:
            if t.index == len(calls):  # a call's first delta has its id, type and name
                assert t.id and t.type == "function" and t.function.name
                calls.append([t.id, t.function.name, ""])
            else:
                assert t.index == len(calls) - 1 and t.id is None and t.function.name is None
            calls[-1][2] += t.function.arguments or ""
    return reasoning or None, content or None, [(n, json.loads(a)) for _, n, a in calls], s.tools_called


CASES = [
    (ANALYSIS + "Need weather.<|end|>" + CALL, ("Need weather.", None, [("get_weather", {"city": "Paris"})])),
    # recipient before the channel, right after the prompt's `<|start|>assistant`
    (' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}',
     (None, None, [("get_time", {"tz": "UTC"})])),
    # two calls in one turn, the second with the recipient first; generation stopped at <|call|> (not in the text)
    (ANALYSIS + "two<|end|>" + CALL + CALL_TO_FIRST[:-len("<|call|>")],
     ("two", None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})])),
    # a preamble on the commentary channel is content; the call follows
    (ANALYSIS + "x<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL,
     ("x", "Checking.", [("get_weather", {"city": "Paris"})])),
    # an empty body: arguments {}
    ("<|channel|>commentary to=functions.ping <|constrain|>json<|message|><|call|>", (None, None, [("ping", {})])),
    # no call: reasoning and the final answer as before
    (ANALYSIS + "easy<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>", ("easy", "It is 4.", [])),
    ("plain text", (None, "plain text", [])),
]


def test_whole_and_streamed_cases():
    for text, (reasoning, content, want) in CASES:
        r, c, found = plan().splitter().whole(text)
        assert (r, c, calls_of(found)) == (reasoning, content, want), text
        assert len({f.id for f in found}) == len(found) and all(f.id.startswith("call_") for f in found)
        for chunks in ([text], list(text)):
            assert streamed(chunks) == (reasoning, content, want, bool(want)), text


def test_finish_reason_and_no_tool_parser():
    assert plan().finish_reason("stop", True) == "tool_calls"
    assert plan().finish_reason("stop", False) == "stop"
    # Without the tool parser the reasoning parser's output is unchanged: the call's body is plain content.
    alone = ChatPlan(reasoning_parser="openai_gptoss").splitter()
    assert alone.whole(ANALYSIS + "a<|end|>" + CALL) == ("a", '{"city":"Paris"}', [])


def test_parser_alone_on_reasoning_output():
    """What the harmony reasoning parser passes on (keep_tool_calls) is what the tool parser reads."""
    r = HarmonyReasoningParser()
    r.keep_tool_calls = True
    reasoning, content = r.extract(ANALYSIS + "think<|end|>" + CALL)
    assert reasoning == "think"
    assert content == '<|channel|>commentary to=functions.get_weather<|message|>{"city":"Paris"}<|call|>'
    got = HarmonyToolParser().extract("Sure. " + content + " done")
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", '{"city":"Paris"}')]
    assert got.content == "Sure.  done" and got.tools_called  # the text on both sides, as it is
    assert get_tool_parser("openai") is HarmonyToolParser
    # a header without a recipient stays content as written; a header cut off too
    assert HarmonyToolParser().extract("<|channel|>final<|message|>hi").content == "<|channel|>final<|message|>hi"
    assert HarmonyToolParser().extract("a <|channel|>commentary to=fun").content == "a <|channel|>commentary to=fun"


PIECES = ["<|channel|>", "<|start|>", "assistant", "analysis", "final", "commentary", " to=functions.f", " to=g",
          " <|constrain|>json", "<|message|>", "<|end|>", "<|return|>", "<|call|>", '{"a": 1}', "<|", "|>", "a", " "]
texts = st.lists(st.sampled_from(PIECES), max_size=25).map("".join)


@SETTINGS
@given(text=texts, data=st.data())
def test_any_chunking_matches_whole(text, data):
    points = sorted(set(p for p in data.draw(st.lists(st.integers(0, len(text)), max_size=10)) if 0 < p < len(text)))
    chunks = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    r, c, found = plan().splitter().whole(text)
    s = plan().splitter()
    parts = [s.feed(x) for x in chunks] + [s.flush()]
    names, args = [], []
    for p in parts:
        for t in p.tool_calls:
            if t.function.name is not None:
                names.append(t.function.name)
                args.append("")
            args[t.index] += t.function.arguments or ""
    assert "".join(p.reasoning or "" for p in parts) == (r or "")
    # a stream drops the content's edge whitespace; a whole output without calls keeps it (as for every parser)
    assert "".join(p.content or "" for p in parts) == (c or "").strip()
    assert [(n, a) for n, a in zip(names, args)] == [(f.function.name, f.function.arguments) for f in found]


def harmony_tokenizer():
    from tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|message|>", "<|end|>", "<|start|>",
                                                          "<|return|>", "<|call|>", "<|constrain|>"]})
    return tok


class FakeSubmission:
    """One choice whose output arrives as the given text pieces (what the engine's detokenizer hands the server)."""

    def __init__(self, pieces: list[str], finish_reason: str = "stop") -> None:
        self.pieces, self.reason = list(pieces), finish_reason
        self.finished = False
        self.choices = [SimpleNamespace(full_text="".join(pieces), token_ids=[], logprobs=None,
                                        finish_reason=finish_reason, stop_reason=None)]

    async def next(self):
        text = self.pieces.pop(0)
        self.finished = not self.pieces
        seq = SimpleNamespace(index=0, text=text, token_ids=[1], logprobs=None, stop_reason=None,
                              finish_reason=self.reason if self.finished else None)
        return SimpleNamespace(sequences=[seq])

    def choice_index(self, delta, seq_index: int) -> int:
        return seq_index

    def abort(self) -> None:
        pass

    def usage(self):
        from tokenmill.serve.protocol import Usage

        return Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)


def test_chat_completion_response_and_stream():
    """The /v1/chat/completions paths (_response, _stream) on an output detokenized token by token with the
    special tokens kept: tool_calls with name, arguments and id, finish_reason tool_calls, reasoning apart."""
    from tokenmill.serve.chat_completions import _response, _stream
    from tokenmill.serve.protocol import ChatCompletionRequest

    tok = harmony_tokenizer()
    text = ANALYSIS + "Need the weather.<|end|>" + CALL[:-len("<|call|>")]  # <|call|> ends generation
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|constrain|>") in ids
    dec = [tok.decode(ids[:i], skip_special_tokens=False) for i in range(len(ids) + 1)]
    pieces = [b[len(a):] for a, b in zip(dec, dec[1:])]
    assert "".join(pieces) == text
    state = SimpleNamespace(engine=SimpleNamespace(tokenizer=tok))
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                                stream=True)

    msg = _response(state, req, FakeSubmission(pieces), "m", plan()).choices[0]
    assert msg.finish_reason == "tool_calls"
    assert msg.message.reasoning_content == "Need the weather." and msg.message.content is None
    assert calls_of(msg.message.tool_calls) == [("get_weather", {"city": "Paris"})]
    assert msg.message.tool_calls[0].id.startswith("call_") and msg.message.tool_calls[0].type == "function"

    async def events():
        return [e async for e in _stream(state, req, FakeSubmission(pieces), "m", plan())]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(events()) if e.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Need the weather."
    assert not any(d.get("content") for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(t["function"].get("arguments") or "" for t in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_request_keeps_special_tokens_with_the_tool_parser():
    from tiny import CHATML
    from tokenmill.serve.chat_completions import prepare_chat
    from tokenmill.serve.protocol import ChatCompletionRequest
    from tokenmill.serve.sampling import Limits

    tok = harmony_tokenizer()

    async def run_blocking(fn, *args, size=0):
        return fn(*args)

    def prepared(parser: str, tools):
        settings_ = SimpleNamespace(chat_template=CHATML, reasoning_parser=None, tool_call_parser=parser,
                                    enable_auto_tool_choice=True)
        state = SimpleNamespace(run_blocking=run_blocking, engine=SimpleNamespace(tokenizer=tok), settings=settings_,
                                limits=Limits(max_model_len=4096, vocab_size=len(tok)))
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                    tools=tools)
        return asyncio.run(prepare_chat(state, req, SimpleNamespace(take_sequences=lambda n: None)))

    assert prepared("openai", TOOLS)[3].skip_special_tokens is False
    assert prepared("openai", None)[3].skip_special_tokens is True  # no tools: no tool parser at work
    assert prepared("hermes", TOOLS)[3].skip_special_tokens is True
