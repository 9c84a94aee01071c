"""Tool-call parsers (hermes, llama3_json, mistral) and the forced-call helpers in serve/tools.py.

Unit tests pin each format; hypothesis tests generate outputs (free text around 0..3 calls whose
arguments nest strings with quotes, braces, backslashes and non-ASCII) and check that streaming them
in any chunking gives what `extract` gives, and that any text at all streams the same however it is cut.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tokenmill.serve.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolParser,
    get_tool_parser,
)
from tokenmill.serve.tools import ConstrainedToolStream, tool_choice_schema, validate_tools

SETTINGS = settings(max_examples=200, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def stream(parser: ToolParser, chunks: list[str]):
    """Feed the chunks and flush; check the OpenAI delta shape; (content, [(id, name, arguments)])."""
    deltas = [parser.feed(c) for c in chunks] + [parser.flush()]
    content = "".join(d.content or "" for d in deltas)
    calls: list[list[str]] = []
    for d in deltas:
        assert d.content != ""
        for tc in d.tool_calls:
            if tc.index == len(calls):  # a new call: the first delta has the id and the name
                assert tc.id and tc.name
                calls.append([tc.id, tc.name, ""])
            else:
                assert tc.index == len(calls) - 1 and tc.id is None and tc.name is None
            calls[-1][2] += tc.arguments or ""
    assert parser.tools_called == bool(calls)
    return content, [tuple(c) for c in calls]


def cut(text: str, points: list[int]) -> list[str]:
    points = sorted(set(p for p in points if 0 < p < len(text)))
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


def check_same(parser_cls, text: str, chunks: list[str], make=None):
    """Streamed in chunks == extract: content, names, arguments (as JSON values); returns the extract."""
    make = make or parser_cls
    want = make().extract(text)
    content, calls = stream(make(), chunks)
    assert content == (want.content or "")
    assert [c[1] for c in calls] == [c.name for c in want.tool_calls]
    for (_, _, args), call in zip(calls, want.tool_calls):
        assert json.loads(args) == json.loads(call.arguments)
    assert want.tools_called == bool(want.tool_calls)
    return want


# -- unit: hermes ---------------------------------------------------------------------------------

def call_block(name, args, key="arguments"):
    return "<tool_call>\n" + json.dumps({"name": name, key: args}) + "\n</tool_call>"


def test_hermes_extract_calls_and_content():
    text = ("Let me check.\n" + call_block("get_weather", {"city": "Paris", "unit": "c"}) + "\n"
            + call_block("get_time", {"tz": "CET"}))
    got = HermesToolParser().extract(text)
    assert got.tools_called and got.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "CET"})]
    assert got.tool_calls[0].arguments == '{"city":"Paris","unit":"c"}'  # compact
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in got.tool_calls)
    assert got.tool_calls[0].id != got.tool_calls[1].id


def test_hermes_no_calls_is_content_stripped():
    got = HermesToolParser().extract("  Hello there!\n")
    assert (got.tools_called, got.tool_calls, got.content) == (False, [], "Hello there!")
    assert HermesToolParser().extract(" \n").content is None


def test_hermes_bad_json_stays_in_content():
    text = "a <tool_call>\n{not json}\n</tool_call> b " + call_block("f", {})
    got = HermesToolParser().extract(text)
    assert got.content == "a <tool_call>\n{not json}\n</tool_call> b"
    assert [c.name for c in got.tool_calls] == ["f"]
    # valid JSON that is not a call (no name) is not a call either
    got = HermesToolParser().extract('<tool_call>{"arguments": {}}</tool_call>')
    assert not got.tools_called and got.content == '<tool_call>{"arguments": {}}</tool_call>'


def test_hermes_unterminated_last_call():
    got = HermesToolParser().extract('x<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert got.content == "x" and [(c.name, c.arguments) for c in got.tool_calls] == [("f", '{"a":1}')]
    got = HermesToolParser().extract('x<tool_call>\n{"name": "f", "arguments": {"a": 1')
    assert not got.tools_called and got.content == 'x<tool_call>\n{"name": "f", "arguments": {"a": 1'


def test_hermes_missing_arguments_and_string_arguments():
    got = HermesToolParser().extract('<tool_call>{"name": "f"}</tool_call>')
    assert got.tool_calls[0].arguments == "{}"
    got = HermesToolParser().extract('<tool_call>{"name": "f", "parameters": {"x": "é"}}</tool_call>')
    assert got.tool_calls[0].arguments == '{"x":"é"}'


def test_hermes_stream_holds_back_a_possible_marker():
    p = HermesToolParser()
    assert p.feed("Hi <tool").content == "Hi"
    assert p.feed("box> ok").content == " <toolbox> ok"
    p = HermesToolParser()
    assert p.feed("Hi <tool").content == "Hi"
    d = p.feed('_call>\n{"name": "f", "argu')
    assert d.content is None and [(t.index, t.name, t.arguments) for t in d.tool_calls] == [(0, "f", None)]
    assert d.tool_calls[0].id.startswith("call_")


def test_hermes_stream_sends_arguments_as_they_arrive():
    p = HermesToolParser()
    out = [p.feed(c) for c in ['<tool_call>{"name": "f", "arguments": {"q": "a b', ' c", "n": [1, ', "2]}}",
                                "</tool_call>"]]
    assert [(t.name, t.arguments) for t in out[0].tool_calls] == [("f", '{"q": "a b')]
    assert [(t.id, t.name, t.arguments) for t in out[1].tool_calls] == [(None, None, ' c", "n": [1, ')]
    assert out[2].tool_calls[0].arguments == "2]}"
    assert out[3].tool_calls == [] and p.flush().tool_calls == []


def test_hermes_stream_buffers_arguments_until_the_name():
    p = HermesToolParser()
    d1 = p.feed('<tool_call>{"arguments": {"a": "}"}, "na')
    assert d1.tool_calls == [] and d1.content is None
    d2 = p.feed('me": "f"}</tool_call>')
    assert [(t.name, t.arguments) for t in d2.tool_calls] == [("f", '{"a": "}"}')]


def test_hermes_stream_bad_block_becomes_content():
    text = "a <tool_call>oops</tool_call> b"
    assert stream(HermesToolParser(), list(text)) == (text, [])
    text = 'a <tool_call>{"x": 1}</tool_call> b'
    assert stream(HermesToolParser(), list(text)) == (text, [])


def test_stream_ends_inside_a_marker_or_call():
    p = HermesToolParser()
    assert p.feed("x <tool_call>").content == "x"
    assert p.flush().content == " <tool_call>"
    assert p.flush() == p.flush()  # flushing again is harmless
    p = MistralToolParser()
    assert p.feed("x [TOOL_CALLS]f[AR").content == "x"
    assert p.flush().content == " [TOOL_CALLS]f[AR"


def test_hermes_stream_commits_once_the_name_is_out():
    # Documented difference: extract sees the JSON is truncated and keeps it as content; a stream
    # has already sent the call and closes it as it stands.
    text = '<tool_call>{"name": "f", "arguments": {"a": 1'
    assert HermesToolParser().extract(text).content == text
    content, calls = stream(HermesToolParser(), [text])
    assert content == "" and [(n, a) for _, n, a in calls] == [("f", '{"a": 1')]


# -- unit: llama3_json ----------------------------------------------------------------------------

def test_llama3_extract():
    p = Llama3JsonToolParser
    got = p().extract('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {"y": [2]}}')
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("f", '{"x":1}'), ("g", '{"y":[2]}')]
    assert got.content is None
    got = p().extract('  {"name": "f", "parameters": {}}')
    assert [c.name for c in got.tool_calls] == ["f"]
    got = p().extract("The answer is {x}.")
    assert not got.tools_called and got.content == "The answer is {x}."
    got = p().extract('{"answer": 42}')  # JSON but not a call
    assert not got.tools_called and got.content == '{"answer": 42}'
    got = p().extract('{"name": "f", "parameters": {}} and then some')
    assert [c.name for c in got.tool_calls] == ["f"] and got.content == "and then some"


def test_llama3_stream():
    p = Llama3JsonToolParser()
    assert p.feed(" <|python") == p.feed("") and p.feed("_tag|>").tool_calls == []
    d = p.feed('{"name": "f", "parameters": {"x"')
    assert [(t.name, t.arguments) for t in d.tool_calls] == [("f", '{"x"')]
    p = Llama3JsonToolParser()
    assert p.feed("Hel").content == "Hel"  # not "{": content from the first character


# -- unit: mistral --------------------------------------------------------------------------------

def test_mistral_extract_array_and_new_forms():
    p = MistralToolParser
    got = p().extract('Sure [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]')
    assert got.content == "Sure" and [(c.name, c.arguments) for c in got.tool_calls] == [("f", '{"a":1}'), ("g", "{}")]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in got.tool_calls)
    got = p().extract('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f2[ARGS]{}')
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", '{"city":"Paris"}'), ("f2", "{}")]
    assert got.content is None
    got = p().extract("[TOOL_CALLS] not a call")
    assert not got.tools_called and got.content == "[TOOL_CALLS] not a call"


def test_mistral_stream_ids_and_marker():
    p = MistralToolParser()
    assert p.feed("ok [TOOL_").content == "ok"
    d = p.feed("CALLS]f[AR")
    assert d.content is None and d.tool_calls == []
    d = p.feed('GS]{"a": "[ARGS]"')
    assert [(t.name, t.arguments) for t in d.tool_calls] == [("f", '{"a": "[ARGS]"')]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", d.tool_calls[0].id)


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "openai"}
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, openai"):
        get_tool_parser("nope")


# -- property: generated outputs ------------------------------------------------------------------

ALPH = 'ab "\'{}[]\\:,;\n\té😀<>/_'
leaves = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(ALPH, max_size=8)
values = st.recursive(
    leaves, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(ALPH, max_size=5), ch, max_size=3),
    max_leaves=8)
arg_dicts = st.dictionaries(st.text(ALPH, max_size=6), values, max_size=4)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
styles = st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 1}, {"ensure_ascii": False}])
FREE = "ab <>/_{}[]\n\"toolcaTOLCAS|p"


@st.composite
def calls(draw, key="arguments"):
    out = []
    for _ in range(draw(st.integers(0, 3))):
        name, args, style = draw(names), draw(arg_dicts), draw(styles)
        obj = {"name": name, key: args}
        if draw(st.booleans()):
            obj = {key: args, "name": name}
        out.append((name, args, json.dumps(obj, **style)))
    return out


def chunked(data, text: str) -> list[str]:
    return cut(text, data.draw(st.lists(st.integers(0, len(text)), max_size=12)))


def check_expected(got, texts: list[str], made: list):
    assert got.content == ("".join(texts).strip() or None)
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [(n, a) for n, a, _ in made]


@SETTINGS
@given(made=calls(), texts=st.lists(st.text(FREE, max_size=12), min_size=4, max_size=4),
       seps=st.lists(st.sampled_from(["", "\n", " \n "]), min_size=2, max_size=2), data=st.data())
def test_hermes_streaming_matches_extract(made, texts, seps, data):
    texts = texts[:len(made) + 1]
    assume(all("<tool_call>" not in t for t in texts))
    out = texts[0] + "".join(f"<tool_call>{seps[0]}{raw}{seps[1]}</tool_call>{t}"
                             for (_, _, raw), t in zip(made, texts[1:]))
    got = check_same(HermesToolParser, out, chunked(data, out))
    check_expected(got, texts, made)


@SETTINGS
@given(made=calls("parameters"), lead=st.sampled_from(["", " ", "\n", "<|python_tag|>", " <|python_tag|>\n"]),
       sep=st.sampled_from([";", "; ", " ;\n"]), plain=st.text(FREE, max_size=20), data=st.data())
def test_llama3_streaming_matches_extract(made, lead, sep, plain, data):
    if made:
        out, texts = lead + sep.join(raw for _, _, raw in made), []
    else:
        assume(not plain.lstrip().startswith(("{", "<|python_tag|>")))
        out, texts = plain, [plain]
    got = check_same(Llama3JsonToolParser, out, chunked(data, out))
    check_expected(got, texts, made)


@SETTINGS
@given(made=calls(), new_form=st.booleans(), texts=st.lists(st.text(FREE, max_size=12), min_size=2, max_size=2),
       data=st.data())
def test_mistral_streaming_matches_extract(made, new_form, texts, data):
    assume(all("[TOOL_CALLS]" not in t for t in texts))
    if new_form:
        assume(made)
        body = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a, _ in made)
    else:
        body = "[TOOL_CALLS] [" + ", ".join(raw for _, _, raw in made) + "]"
    out = texts[0] + body + texts[1]
    got = check_same(MistralToolParser, out, chunked(data, out))
    check_expected(got, texts, made)


@SETTINGS
@given(made=calls("parameters"), lead=st.sampled_from(["", " ", "\n"]), data=st.data())
def test_required_streaming_matches_extract(made, lead, data):
    assume(made)
    out = lead + "[" + ",".join(raw for _, _, raw in made) + "]"
    got = check_same(None, out, chunked(data, out), make=lambda: ConstrainedToolStream("required"))
    check_expected(got, [], made)


TOKENS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]",
          '"name"', '"arguments"', '"parameters"', ":", ",", ";", '"f"', '"', "\\", " ", "\n", "a", "1", "<", "é"]


@SETTINGS
@given(name=st.sampled_from(sorted(TOOL_PARSERS) + ["required"]),
       text=st.lists(st.sampled_from(TOKENS), max_size=30).map("".join), data=st.data())
def test_any_text_streams_the_same_however_cut(name, text, data):
    make = (lambda: ConstrainedToolStream("required")) if name == "required" else get_tool_parser(name)
    whole = stream(make(), [text])
    parts = stream(make(), chunked(data, text))
    assert (whole[0], [c[1:] for c in whole[1]]) == (parts[0], [c[1:] for c in parts[1]])


# -- tools.py -------------------------------------------------------------------------------------

def tool(name, params=None, **extra):
    fn = {"name": name, **extra}
    if params is not None:
        fn["parameters"] = params
    return {"type": "function", "function": fn}


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [tool("get_weather", WEATHER, description="Weather now"), tool("ping")]


def test_validate_tools_accepts():
    for choice in (None, "none", "auto", "required", {"type": "function", "function": {"name": "ping"}}):
        validate_tools(TOOLS, choice)
    validate_tools(None, "auto")
    validate_tools(None, "none")


@pytest.mark.parametrize("tools,choice,msg", [
    ([{"type": "retrieval"}], "auto", r'tools\[0\]: type must be "function"'),
    ([{"type": "function"}], "auto", r"tools\[0\]: function must be an object"),
    ([{"type": "function", "function": {"name": ""}}], "auto", r"tools\[0\].function.name"),
    ([tool("f", [])], "auto", r"tools\[0\].function.parameters"),
    ([tool("f", description=3)], "auto", r"tools\[0\].function.description"),
    ("f", "auto", "tools must be a list"),
    (TOOLS, "sometimes", "tool_choice must be"),
    (TOOLS, {"type": "function"}, "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
    (None, "required", "'required' needs tools"),
    ([], {"type": "function", "function": {"name": "f"}}, "'f' needs tools"),
])
def test_validate_tools_rejects(tools, choice, msg):
    with pytest.raises(ValueError, match=msg):
        validate_tools(tools, choice)


def test_tool_choice_schema():
    assert tool_choice_schema(TOOLS, "auto") is None and tool_choice_schema(TOOLS, "none") is None
    assert tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}}) == WEATHER
    assert tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "ping"}}) == {
        "type": "object", "properties": {}}
    schema = tool_choice_schema(TOOLS, "required")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["items"]["anyOf"][0] == {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER},
        "required": ["name", "parameters"], "additionalProperties": False}
    assert tool_choice_schema(TOOLS, "required", parallel_tool_calls=False)["maxItems"] == 1
    ok = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, tool_choice_schema(TOOLS, "required", parallel_tool_calls=False))


def test_constrained_named():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    got = ConstrainedToolStream(choice).extract('{ "city": "Oslo" }')
    assert got.tools_called and got.content is None
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", '{"city":"Oslo"}')]
    p = ConstrainedToolStream(choice)
    d = p.feed('{"ci')
    assert [(t.index, t.name, t.arguments) for t in d.tool_calls] == [(0, "get_weather", '{"ci')]
    assert d.tool_calls[0].id.startswith("call_")
    assert [(t.id, t.name, t.arguments) for t in p.feed('ty": "Oslo"}').tool_calls] == [(None, None, 'ty": "Oslo"}')]
    assert p.flush().tool_calls == [] and p.tools_called
    assert ConstrainedToolStream(choice).extract('{"city": "Os').tool_calls[0].arguments == '{"city": "Os'
    with pytest.raises(ValueError, match="does not force a call"):
        ConstrainedToolStream("auto")


def test_constrained_required():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "ping", "parameters": {}}]'
    got = ConstrainedToolStream("required").extract(text)
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", '{"city":"Oslo"}'), ("ping", "{}")]
    assert got.content is None
    content, streamed = stream(ConstrainedToolStream("required"), list(text))
    assert content == "" and [(n, a) for _, n, a in streamed] == [("get_weather", '{"city": "Oslo"}'), ("ping", "{}")]


# -- "required" cut short by max_tokens: the complete calls, never a partial call as content ----------

TRUNCATED = ('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "ping", "parameters": {}}, '
             '{"name": "get_wea')


def test_required_truncated_keeps_complete_calls_and_no_content():
    got = ConstrainedToolStream("required").extract(TRUNCATED)
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", '{"city":"Oslo"}'), ("ping", "{}")]
    assert got.content is None
    # Cut inside the arguments of the third call, or between calls: the same.
    for cut_text in ('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": [1, 2',
                     '[{"name": "a", "parameters": {}},', '[{"name": "a", "parameters": {}} '):
        got = ConstrainedToolStream("required").extract(cut_text)
        assert [c.name for c in got.tool_calls] == ["a"] and got.content is None, cut_text
    # No call complete yet: no calls and still no content.
    got = ConstrainedToolStream("required").extract('[{"name": "get_weather", "param')
    assert not got.tools_called and got.content is None
    # Streamed: no content either; the calls whose names went out are closed.
    content, streamed = stream(ConstrainedToolStream("required"), list(TRUNCATED))
    assert content == "" and [n for _, n, _ in streamed] == ["get_weather", "ping", "get_wea"][:len(streamed)]
    assert [(n, json.loads(a)) for _, n, a in streamed[:2]] == [("get_weather", {"city": "Oslo"}), ("ping", {})]
    # Text after a closed array, or an output that is no array at all, is content as before.
    got = ConstrainedToolStream("required").extract('[{"name": "a", "parameters": {}}] done')
    assert [c.name for c in got.tool_calls] == ["a"] and got.content == "done"
    assert ConstrainedToolStream("required").extract("no array").content == "no array"


def test_chat_splitter_drops_a_cut_call():
    """The response path (ChoiceSplitter.whole): the cut call is not content, also with no call complete."""
    from tokenmill.serve.chat_output import ChatPlan

    plan = ChatPlan(tools=[tool("get_weather", WEATHER), tool("ping")], tool_choice="required")
    reasoning, content, found = plan.splitter().whole(TRUNCATED)
    assert content is None and [c.function.name for c in found] == ["get_weather", "ping"]
    assert plan.splitter().whole('[{"name": "get_weather", "param')[1:] == (None, [])
    assert plan.finish_reason("length", True) == "length"  # cut short: not "tool_calls"
    splitter = plan.splitter()
    parts = [splitter.feed(c) for c in TRUNCATED] + [splitter.flush()]
    assert all(p.content is None for p in parts)


@SETTINGS
@given(made=calls("parameters"), lead=st.sampled_from(["", " ", "\n"]), data=st.data())
def test_required_cut_anywhere(made, lead, data):
    """Any prefix of a required output: extract has exactly the calls complete in it and no content; the
    stream sends no content and its calls are those, maybe followed by the cut one."""
    assume(made)
    raws = [raw for _, _, raw in made]
    out = lead + "[" + ",".join(raws) + "]"
    at = data.draw(st.integers(0, len(out) - 1))
    text = out[:at]
    ends, pos = [], len(lead) + 1
    for raw in raws:
        ends.append(pos + len(raw))
        pos += len(raw) + 1
    complete = [(n, a) for (n, a, _), end in zip(made, ends) if end <= at]
    got = ConstrainedToolStream("required").extract(text)
    assert got.content is None
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == complete
    content, streamed = stream(ConstrainedToolStream("required"), chunked(data, text))
    assert content == ""
    assert [(n, json.loads(a)) for _, n, a in streamed[:len(complete)]] == complete
    assert len(streamed) <= len(complete) + 1
