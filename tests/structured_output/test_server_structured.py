"""Structured output, tools and reasoning through `tokenmill serve` on tiny random models, driven by the
official `openai` client: a random model's output is valid only if the constraint made it so."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from server_harness import start_server
from tiny import make_tiny_model

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**6},
                                           "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Reasoning template: the generation prompt opens a <think> block unless enable_thinking is false, in which
# case it renders an empty one (as Qwen3's template does); with open_think=false it opens nothing.
THINK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% elif open_think is defined and not open_think %}"  # as Qwen3 (thinking on) and older R1 templates
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("so") / "llama", "llama", max_position_embeddings=2048)
    srv = start_server(path, path.parent / "server.log", "--served-model-name", MODEL,
                       "--kv-cache-memory-bytes", "32M", "--max-model-len", "2048",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("think") / "llama", "llama", added_tokens=("<think>", "</think>"),
                           max_position_embeddings=2048)
    template = path.parent / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    srv = start_server(path, path.parent / "server.log", "--served-model-name", MODEL,
                       "--kv-cache-memory-bytes", "32M", "--max-model-len", "2048",
                       "--reasoning-parser", "deepseek_r1", "--chat-template", str(template))
    yield srv
    assert srv.stop() == 0, srv.log()


def _stream_text(chunks) -> tuple[str, str | None]:
    text, finish = [], None
    for c in chunks:
        if c.choices:
            text.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
    return "".join(text), finish


# ---- response_format and structured_outputs --------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_response_format_json_schema(client, seed):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    # The same request streamed: the fragments join into JSON just as valid (and equal, given the seed).
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    text, finish = _stream_text(chunks)
    assert finish == "stop" and text == c.message.content


def test_response_format_json_object_and_completions(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=3, max_tokens=300,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an object may nest without end under a random model; what was produced is still a JSON prefix
        assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model=MODEL, prompt="Answer:", temperature=1.0, seed=0, max_tokens=30,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe not"]}})
    assert r.choices[0].text in ("yes", "no", "maybe not") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,5}"}}, r"[0-9]{3}-[a-z]{2,5}"),
    ({"guided_regex": "(ab|cd){2}x?"}, r"(ab|cd){2}x?"),
    ({"guided_choice": ["red", "reddish", "blue"]}, r"red|reddish|blue"),
    ({"structured_outputs": {"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'}}, r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}}, None),
])
def test_structured_outputs_fields(client, body, check):
    import re

    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed,
                                           max_tokens=80, extra_body=body)
        text = r.choices[0].message.content
        if check is not None:
            assert re.fullmatch(check, text), text
            assert r.choices[0].finish_reason == "stop"
        else:
            assert 2 <= len(json.loads(text)) <= 3


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs", "undefined_rule"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200}
                                                                        for i in range(2000)}}}},
     "structured_outputs", "limit"),
])
def test_bad_constraints_are_400(server, body, param, words):
    r = httpx.post(server.url("/v1/chat/completions"), timeout=30,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    # The server still answers.
    ok = httpx.post(server.url("/v1/chat/completions"), timeout=30,
                    json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
    assert ok.status_code == 200


def test_pydantic_parse(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        founded: int = Field(ge=0, le=2100)

    completions = client.beta.chat.completions if hasattr(client, "beta") and hasattr(client.beta, "chat") \
        else client.chat.completions
    r = completions.parse(model=MODEL, messages=MESSAGES, temperature=1.0, seed=5, max_tokens=120,
                          response_format=City)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and 0 <= city.founded <= 2100


# ---- tools --------------------------------------------------------------------------------------
def _check_call(call, tools=(WEATHER, TIME)):
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), spec[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named(client, stream):
    kw = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], temperature=1.0, seed=7, max_tokens=120,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "stop" and len(c.message.tool_calls) == 1 and not c.message.content
        assert c.message.tool_calls[0].function.name == "get_weather"
        _check_call(c.message.tool_calls[0])
        return
    calls, finish, content, fragments = {}, None, "", 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "args": ""})
            assert t.function.name is None or t.id is not None  # the name comes once, with the id
            entry["args"] += t.function.arguments or ""
            fragments += bool(t.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and not content and list(calls) == [0]
    assert fragments > 3  # the arguments arrive as they are generated, not in one piece at the end
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["args"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required(client, parallel):
    # A random model at temperature 1 may write parallel calls until max_tokens (finish "length", only the
    # complete calls returned: see the test below); three seeds must finish with their calls.
    finished = 0
    for seed in range(15):
        if finished == 3:
            break
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=parallel, temperature=1.0,
                                           seed=seed, max_tokens=250)
        c = r.choices[0]
        assert c.finish_reason in ("tool_calls", "length"), c
        assert c.message.content is None
        for call in c.message.tool_calls or []:
            _check_call(call)
        if c.finish_reason == "length":
            continue
        finished += 1
        assert len(c.message.tool_calls) >= 1 and (parallel or len(c.message.tool_calls) == 1)
        # Streamed: the same calls, arguments in fragments.
        calls = {}
        for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
                                                    tool_choice="required", parallel_tool_calls=parallel,
                                                    temperature=1.0, seed=seed, max_tokens=250, stream=True):
            for t in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = calls.setdefault(t.index, {"name": t.function.name, "args": ""})
                entry["args"] += t.function.arguments or ""
        assert [(e["name"], json.loads(e["args"])) for _, e in sorted(calls.items())] == [
            (x.function.name, json.loads(x.function.arguments)) for x in c.message.tool_calls]
    assert finished == 3


def test_tool_round_trip(client):
    tools = [WEATHER]
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                           temperature=1.0, seed=1, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "unit": "c"})},
    ]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none",
                                           temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    c = final.choices[0]
    assert c.message.tool_calls is None and isinstance(c.message.content, str) and c.finish_reason == "length"
    assert final.usage.completion_tokens == 8
    # The template (here the fallback for one without tools) rendered the call and its result.
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + len(call.function.arguments) // 4


HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,6}", "unit": "(c|f)"\}\}\n</tool_call>'


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_auto_parses_calls(client, parallel):
    """Under "auto" the server's hermes parser pulls calls out of the text. The random model is made to write
    two calls in Hermes format (by a regex constraint) so the parse is exercised end to end, both ways."""
    body = {"structured_outputs": {"regex": rf"Checking\.\n{HERMES_CALL}\n{HERMES_CALL}"}}
    kw = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=parallel,
              temperature=1.0, seed=4, max_tokens=300, extra_body=body)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    assert len(c.message.tool_calls) == (2 if parallel else 1)
    for call in c.message.tool_calls:
        assert call.function.name == "get_weather"
        _check_call(call)
    calls, content, finish = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "args": ""})
            entry["args"] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "Checking."
    assert [(e["name"], json.loads(e["args"])) for _, e in sorted(calls.items())] == [
        (x.function.name, json.loads(x.function.arguments)) for x in c.message.tool_calls]
    assert all(e["id"] for e in calls.values())


def test_tool_choice_auto_plain_text(client):
    """Under "auto" the model may answer in text: no tool calls, finish_reason stop/length, content kept."""
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], temperature=0,
                                       max_tokens=10, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content and not c.message.tool_calls


def test_bad_tools_are_400(server):
    url = server.url("/v1/chat/completions")
    cases = [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ]
    for body, param in cases:
        r = httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_tool_choice_required_cut_by_max_tokens(client):
    """Calls written until max_tokens: the complete ones come back as tool_calls, the cut one is dropped
    (never message.content), finish_reason "length"; streamed, no content either."""
    kw = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0)
    for seed in range(20):
        full = client.chat.completions.create(seed=seed, max_tokens=400, **kw)
        if full.choices[0].finish_reason == "tool_calls" and len(full.choices[0].message.tool_calls) >= 2:
            break
    else:
        pytest.fail("no seed made two calls")
    want = [(c.function.name, json.loads(c.function.arguments)) for c in full.choices[0].message.tool_calls]
    # The longest cut that loses a call: the last call is cut short, the others are complete.
    for max_tokens in range(full.usage.completion_tokens - 1, 0, -1):
        c = client.chat.completions.create(seed=seed, max_tokens=max_tokens, **kw).choices[0]
        if len(c.message.tool_calls or []) < len(want):
            break
    assert c.finish_reason == "length" and c.message.content is None, c
    assert [(x.function.name, json.loads(x.function.arguments)) for x in c.message.tool_calls] == want[:-1]
    content = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        seed=seed, max_tokens=max_tokens, stream=True, **kw) if ch.choices)
    assert content == ""


# ---- grammars over the limits: a 400, and the server lives (issue 24 item 0) ----------------------------------
def _chained(n: int) -> str:
    return "\n".join(["start: r0"] + [f'r{i}: "x{i}" r{i + 1} | "y{i}"' for i in range(n)] + [f'r{n}: "z"'])


def _nested(levels: int) -> dict:
    s: dict = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "boolean"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_grammars_over_the_limits_are_400_and_the_server_lives(server):
    """The issue's grammar (3,000 chained rules, 88.6 KB) killed the API process with no response; now it and
    deeper ones are a 400 naming the limit, and the same server answers the next request."""
    deep_tool = {"type": "function", "function": {"name": "deep", "parameters": _nested(100)}}
    cases = [
        ("chat", {"guided_grammar": _chained(3000)}, "guided_grammar", "limit is 2000"),
        ("chat", {"structured_outputs": {"grammar": _chained(400)}}, "structured_outputs", "limit is 300"),
        ("completions", {"guided_grammar": _chained(3000)}, "guided_grammar", "limit is 2000"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": _nested(100)}}},
         "response_format", "limit is 128"),
        ("chat", {"guided_json": _ref_chain(60)}, "guided_json", "limit is 1000"),
        ("completions", {"structured_outputs": {"regex": "(a" * 100 + ")" * 100}}, "structured_outputs",
         "limit is 64"),
        ("chat", {"tools": [deep_tool], "tool_choice": "required"}, "tools", "limit is 128"),
    ]
    for route, body, param, message in cases:
        prompt = {"messages": MESSAGES} if route == "chat" else {"prompt": "Answer:"}
        r = httpx.post(server.url(f"/v1/{route.replace('chat', 'chat/completions')}"),
                       json={"model": MODEL, "max_tokens": 5, **prompt, **body}, timeout=60)
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], err
    assert server.proc.poll() is None
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 20, "guided_grammar": _chained(5)})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text.startswith(("x0", "y0")), text


# ---- reasoning ----------------------------------------------------------------------------------
def _end_id(srv) -> int:
    ids = httpx.post(srv.url("/tokenize"), json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1
    return ids[0]


def test_reasoning_all_reasoning_without_end_tag(think_server):
    """deepseek_r1: the template opened <think>; with no </think> in the output all of it is reasoning."""
    c = openai.OpenAI(base_url=think_server.url("/v1"), api_key="x", timeout=60, max_retries=0)
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12,
              logit_bias={str(_end_id(think_server)): -100}, extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    assert reasoning and msg.content is None
    streamed_r, streamed_c = _streamed_reasoning(c, kw)
    assert streamed_r == reasoning and streamed_c == ""


def _streamed_reasoning(c, kw: dict) -> tuple[str, str]:
    """(reasoning, content) of a streamed chat completion, the deltas joined."""
    reasoning, content = "", ""
    for chunk in c.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            d = chunk.choices[0].delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
    return reasoning, content


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("open_think", [False, True])
def test_reasoning_of_a_multi_turn_chat_with_earlier_think_blocks(think_server, stream, open_think):
    """issue 25: an earlier assistant turn's `</think>` (the normal shape of a reasoning conversation) used to
    turn the parser off, so this turn's reasoning came back as content. Only the generation prompt counts."""
    c = openai.OpenAI(base_url=think_server.url("/v1"), api_key="x", timeout=60, max_retries=0)
    messages = [{"role": "user", "content": "What is 5 plus 5?"},
                {"role": "assistant", "content": "<think>5 plus 5 equals 10.</think>The answer is 10."},
                {"role": "user", "content": "And 6 plus 6?"}]
    kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=12,
              logit_bias={str(_end_id(think_server)): -100},
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"open_think": open_think}})
    if not stream:
        msg = c.chat.completions.create(**kw).choices[0].message
        reasoning, content = (msg.model_extra or {}).get("reasoning_content"), msg.content
    else:
        reasoning, content = _streamed_reasoning(c, kw)
    assert reasoning and not content


def test_reasoning_then_constrained_answer(think_server):
    """The JSON constraint starts after </think>: push the model to close its reasoning, then the answer
    validates while the reasoning before it is free text."""
    http = httpx.Client(base_url=think_server.base_url, timeout=60)
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 1.0, "max_tokens": 200,
            "logit_bias": {str(_end_id(think_server)): 6.0},
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}
    for seed in range(3):
        r = http.post("/v1/chat/completions", json={**body, "seed": seed}).json()
        msg = r["choices"][0]["message"]
        jsonschema.validate(json.loads(msg["content"]), SCHEMA)
        assert "</think>" not in (msg.get("reasoning_content") or "")
        chunks = []
        with http.stream("POST", "/v1/chat/completions", json={**body, "seed": seed, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
        assert ("".join(d.get("reasoning_content") or "" for d in deltas) or None) == msg.get("reasoning_content")


def test_reasoning_disabled_by_template_kwargs(think_server):
    """enable_thinking=false renders an empty think block: the prompt closed the reasoning, so everything is
    content and the constraint applies from the first token."""
    c = openai.OpenAI(base_url=think_server.url("/v1"), api_key="x", timeout=60, max_retries=0)
    r = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert not (msg.model_extra or {}).get("reasoning_content")
    jsonschema.validate(json.loads(msg.content), SCHEMA)
