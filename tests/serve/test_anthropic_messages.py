"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) driven by the official `anthropic` SDK against
one live server on a tiny random model with tenant keys, a reasoning parser and a tool parser. The SDK's own types
parse every response and stream event; a random model's tool input is valid only because the call was forced under
the tool's schema.

The chat template opens a `<think>` block unless `enable_thinking` is false (as Qwen3's does): requests that want
plain text send `thinking: {"type": "disabled"}`, which the server maps onto that template variable."""
from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import pytest

from server_harness import start_server
from tiny import make_tiny_model

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
KEYS = """
tenants:
  - {name: team-a, keys: [sk-a]}
  - {name: team-b, keys: [sk-b]}
  - {name: team-r, keys: [sk-r], models: [tiny], limits: {requests_per_minute: 1}}
"""
THINK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}")
WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                             "unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"type": "disabled"}
INTERNAL = "sk-internal"  # reads /metrics
# SDK 2.x has no temperature / top_p / top_k arguments any more; the API (and this server) still reads them.
GREEDY = {"temperature": 0, "ignore_eos": True}  # ignore_eos, seed: tokenmill extensions, as on chat completions


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic")
    path = make_tiny_model(root / "llama", "llama", added_tokens=("<think>", "</think>"), max_position_embeddings=2048)
    (root / "think.jinja").write_text(THINK_TEMPLATE)
    (root / "keys.yaml").write_text(KEYS)
    srv = start_server(path, root / "server.log", "--served-model-name", MODEL, "--kv-cache-memory-bytes", "32M",
                       "--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--reasoning-parser", "deepseek_r1", "--chat-template", str(root / "think.jinja"),
                       "--api-keys-file", str(root / "keys.yaml"), "--usage-db", str(root / "usage.db"),
                       "--internal-api-key", INTERNAL)
    yield srv
    assert srv.stop() == 0, srv.log()


def sdk(server, key: str = "sk-a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def client(server):
    return sdk(server)


def raw_events(client, **kw) -> list:
    """Every event of a `stream=True` request, as the SDK's types."""
    with client.messages.create(stream=True, **kw) as stream:
        return list(stream)


def check_event_order(events) -> None:
    """message_start, then blocks each opened, filled and closed in index order, message_delta, message_stop (the
    SDK drops pings: see sse_lines)."""
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    open_index, next_index = None, 0
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_index is None and e.index == next_index
            open_index, next_index = e.index, next_index + 1
        elif e.type == "content_block_delta":
            assert e.index == open_index
        else:
            assert e.type == "content_block_stop" and e.index == open_index, e
            open_index = None
    assert open_index is None


def sse_lines(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream, read with httpx: every event is `event: <type>` then `data: <json>`
    whose type is the same."""
    out = []
    with httpx.stream("POST", server.url("/v1/messages"), json={**body, "stream": True}, timeout=60,
                      headers={"x-api-key": "sk-a", "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    for chunk in text.split("\n\n")[:-1]:
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
        assert out[-1][0] == out[-1][1]["type"]
    assert text.endswith("\n\n")
    return out


def count(client, **kw) -> int:
    return client.messages.count_tokens(model=MODEL, **kw).input_tokens


def blocks(message) -> list[dict]:
    """A message's content blocks as data (the streaming helper's parsed blocks carry one more field)."""
    return [b.model_dump(exclude={"parsed_output"}, exclude_none=True) for b in message.content]


def prompt_tokens(message) -> int:
    u = message.usage
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


# ---- text, streamed and not ----------------------------------------------------------------------------------------
def test_text_message_streamed_and_not(server, client):
    kw = dict(model=MODEL, max_tokens=6, messages=ASK, thinking=NO_THINKING, extra_body=GREEDY)
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 6 and m.usage.cache_creation_input_tokens == 0
    assert prompt_tokens(m) == count(client, messages=ASK, thinking=NO_THINKING)
    # The same request again: its prompt is in the prefix cache now, and usage says so.
    again = client.messages.create(**kw)
    assert blocks(again) == blocks(m) and again.usage.cache_read_input_tokens > 0
    assert prompt_tokens(again) == prompt_tokens(m)

    # client.messages.stream: text as it comes, and a final message equal to the whole one.
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text and blocks(final) == blocks(m)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert prompt_tokens(final) == prompt_tokens(m)

    events = raw_events(client, **kw)
    check_event_order(events)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert all(d.type == "text_delta" for d in deltas) and "".join(d.text for d in deltas) == m.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6
    # On the wire: a ping right after message_start, and the same events the SDK read.
    wire = sse_lines(server, {"model": MODEL, "max_tokens": 6, "messages": ASK, "thinking": NO_THINKING, **GREEDY})
    assert [name for name, _ in wire] == ["message_start", "ping"] + [e.type for e in events[1:]]


def test_system_blocks_and_string_are_one_prompt(client):
    """`system` as a string or as text blocks renders the same prompt; a prefill (a final assistant message) is
    continued, not answered."""
    as_string = count(client, messages=ASK, system="Be brief.\nAnswer in French.", thinking=NO_THINKING)
    as_blocks = count(client, messages=ASK, thinking=NO_THINKING,
                      system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in French."}])
    assert as_string == as_blocks > count(client, messages=ASK, thinking=NO_THINKING)
    prefill = ASK + [{"role": "assistant", "content": "The weather is"}]
    m = client.messages.create(model=MODEL, max_tokens=3, messages=prefill, thinking=NO_THINKING, extra_body=GREEDY)
    assert m.usage.output_tokens == 3 and prompt_tokens(m) == count(client, messages=prefill, thinking=NO_THINKING)


def test_stop_sequences(client):
    kw = dict(model=MODEL, messages=ASK, thinking=NO_THINKING, extra_body=GREEDY)
    text = client.messages.create(max_tokens=12, **kw).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    m = client.messages.create(max_tokens=12, stop_sequences=["never-generated", stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert "".join(b.text for b in m.content) == text[:text.index(stop)]
    final = [e for e in raw_events(client, max_tokens=12, stop_sequences=[stop], **kw) if e.type == "message_delta"]
    assert final[0].delta.stop_reason == "stop_sequence" and final[0].delta.stop_sequence == stop


def test_thinking_blocks_from_the_reasoning_parser(client):
    """The template opened <think> and the random model never closes it: all of the output is reasoning, a
    thinking block (streamed as thinking_delta); with thinking disabled the same prompt gets a text block."""
    kw = dict(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY)
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking
    events = raw_events(client, **kw)
    check_event_order(events)
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["thinking"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == {"thinking_delta"}
    assert "".join(d.thinking for d in deltas) == m.content[0].thinking
    plain = client.messages.create(thinking=NO_THINKING, **kw)
    assert [b.type for b in plain.content] == ["text"]


# ---- tools -----------------------------------------------------------------------------------------------------------
def forced_call(client, tool_choice: dict, max_tokens: int = 200):
    """A seed whose forced call finishes within max_tokens (a random model may pad the JSON with whitespace)."""
    for seed in range(10):
        m = client.messages.create(model=MODEL, max_tokens=max_tokens, messages=ASK, tools=[WEATHER],
                                   tool_choice=tool_choice, thinking=NO_THINKING,
                                   extra_body={"temperature": 1.0, "seed": seed})
        if m.stop_reason == "tool_use":
            return seed, m
        assert m.stop_reason == "max_tokens", m
    pytest.fail("no seed finished its call")


def test_tool_round_trip(client):
    seed, m = forced_call(client, {"type": "tool", "name": "get_weather"})
    assert [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # The next turn: the assistant's tool_use as it came back, then the user's tool_result.
    def turn(result: dict) -> list:
        return ASK + [{"role": "assistant", "content": m.content},
                      {"role": "user", "content": [result, {"type": "text", "text": "And tomorrow?"}]}]

    result = {"type": "tool_result", "tool_use_id": call.id, "content": json.dumps({"temperature": 21})}
    messages = turn(result)
    final = client.messages.create(model=MODEL, max_tokens=5, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "none"}, thinking=NO_THINKING, extra_body=GREEDY)
    assert [b.type for b in final.content] == ["text"] and final.stop_reason == "max_tokens"
    with_call = count(client, messages=messages, tools=[WEATHER], thinking=NO_THINKING)
    assert prompt_tokens(final) == with_call
    # The call and its result are in the prompt: more than the first turn by at least the call's arguments.
    first = count(client, messages=ASK, tools=[WEATHER], thinking=NO_THINKING)
    assert with_call > first + len(json.dumps(call.input)) // 4
    assert prompt_tokens(m) == first
    # A result as text blocks is the same prompt as the string; an error result says so (more tokens).
    as_blocks = turn({**result, "content": [{"type": "text", "text": result["content"]}]})
    assert count(client, messages=as_blocks, tools=[WEATHER], thinking=NO_THINKING) == with_call
    as_error = turn({**result, "is_error": True})
    assert count(client, messages=as_error, tools=[WEATHER], thinking=NO_THINKING) > with_call


def test_tool_use_streamed(client):
    """tool_choice any, streamed: one tool_use block whose input arrives in input_json_delta fragments as it is
    generated, equal to the whole answer's for the same seed; stop_reason tool_use."""
    seed, m = forced_call(client, {"type": "any"})
    kw = dict(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"},
              thinking=NO_THINKING, extra_body={"temperature": 1.0, "seed": seed})
    events = raw_events(client, **kw)
    check_event_order(events)
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == [b.type for b in m.content] and starts[0].name == "get_weather"
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 0]
    assert len(fragments) > 3
    assert json.loads("".join(fragments)) == m.content[0].input
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in m.content]
    assert final.stop_reason == "tool_use"


def test_output_config_json_schema(client):
    """output_config.format: the text follows the schema (a random model's JSON is valid only if the grammar made
    it so); combined with a forced tool call it is a 400."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "warm": {"type": "boolean"}},
              "required": ["city", "warm"], "additionalProperties": False}
    kw = dict(model=MODEL, max_tokens=150, messages=ASK, thinking=NO_THINKING,
              output_config={"format": {"type": "json_schema", "schema": schema}})
    for seed in range(10):
        m = client.messages.create(extra_body={"temperature": 1.0, "seed": seed}, **kw)
        assert [b.type for b in m.content] == ["text"]
        if m.stop_reason == "end_turn":
            break
        assert m.stop_reason == "max_tokens" and m.content[0].text.lstrip().startswith("{")
    else:
        pytest.fail("no seed finished its JSON")
    jsonschema.validate(json.loads(m.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(tools=[WEATHER], tool_choice={"type": "any"}, **kw)
    assert "output_config" in e.value.body["error"]["message"]


def used(server, key: str) -> int:
    rows = httpx.get(server.url("/v1/usage"), params={"group_by": "tenant"}, timeout=30,
                     headers={"Authorization": f"Bearer {key}"}).json()["data"]
    return sum(row["prompt_tokens"] + row["completion_tokens"] for row in rows)


def metric(server, name: str, label: str = "") -> float:
    """A Prometheus sample's value, summed over the label sets that hold `label` (e.g. 'tenant="team-b"')."""
    text = httpx.get(server.url("/metrics"), headers={"Authorization": f"Bearer {INTERNAL}"}, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def test_a_client_leaving_a_stream_frees_its_work(server, client):
    """A client that closes a stream after its first delta: the engine request is aborted (the tenant is metered
    for far fewer than max_tokens) and every KV block is freed."""
    before = used(server, "sk-a")
    body = {"model": MODEL, "max_tokens": 1800, "messages": ASK, "thinking": NO_THINKING, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url("/v1/messages"), json=body, headers={"x-api-key": "sk-a"}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line == "event: content_block_delta")
    deadline = time.monotonic() + 30
    while (metric(server, "tokenmill:num_requests_running") or metric(server, "tokenmill:kv_cache_usage_perc")
           or used(server, "sk-a") == before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "tokenmill:num_requests_running") == 0
    assert metric(server, "tokenmill:kv_cache_usage_perc") == 0
    assert 0 < used(server, "sk-a") - before < count(client, messages=ASK, thinking=NO_THINKING) + 1800
    assert client.messages.create(model=MODEL, max_tokens=2, messages=ASK).usage.output_tokens >= 1


# ---- auth, metering, errors ------------------------------------------------------------------------------------------
def test_keys_tenants_and_metering(server, client):
    before = used(server, "sk-b")
    counted = [metric(server, f"tokenmill:tenant_{kind}", 'tenant="team-b"')
               for kind in ("requests_total", "prompt_tokens_total", "generation_tokens_total")]
    m = sdk(server, "sk-b").messages.create(model=MODEL, max_tokens=3, messages=ASK, thinking=NO_THINKING,
                                            extra_body={"ignore_eos": True})
    spent = prompt_tokens(m) + m.usage.output_tokens
    deadline = time.monotonic() + 30  # the middleware meters once the response is sent
    while used(server, "sk-b") != before + spent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert used(server, "sk-b") == before + spent
    # The tenant's Prometheus counters, as for chat completions: one request, its prompt and generated tokens.
    assert [metric(server, f"tokenmill:tenant_{kind}", 'tenant="team-b"') - c for kind, c in zip(
        ("requests_total", "prompt_tokens_total", "generation_tokens_total"), counted)] == [
        1, prompt_tokens(m), m.usage.output_tokens]
    # Authorization: Bearer works as well as x-api-key.
    r = httpx.post(server.url("/v1/messages"), headers={"Authorization": "Bearer sk-a"}, timeout=60,
                   json={"model": MODEL, "max_tokens": 1, "messages": ASK})
    assert r.status_code == 200 and r.json()["type"] == "message"

    with pytest.raises(anthropic.AuthenticationError) as e:
        sdk(server, "sk-wrong").messages.create(model=MODEL, max_tokens=1, messages=ASK)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    for path, body in (("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": ASK}),
                       ("/v1/messages/count_tokens", {"model": MODEL, "messages": ASK})):
        r = httpx.post(server.url(path), json=body, timeout=30)  # no key at all
        assert r.status_code == 401 and r.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": r.json()["error"]["message"]}}
        assert "x-api-key" in r.json()["error"]["message"] and "team-" not in r.text
    # A tenant's limits hold here too, refused in Anthropic's shape (the SDK's RateLimitError), naming no other tenant.
    limited = sdk(server, "sk-r")
    assert limited.messages.create(model=MODEL, max_tokens=1, messages=ASK).type == "message"
    with pytest.raises(anthropic.RateLimitError) as e:
        limited.messages.create(model=MODEL, max_tokens=1, messages=ASK)
    assert e.value.status_code == 429 and e.value.body["error"]["type"] == "rate_limit_error"
    assert "team-a" not in json.dumps(e.value.body) and "team-b" not in json.dumps(e.value.body)
    # Other routes keep OpenAI's shape.
    r = httpx.post(server.url("/v1/chat/completions"), headers={"x-api-key": "sk-wrong"}, timeout=30,
                   json={"model": MODEL, "max_tokens": 1, "messages": ASK})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "image blocks are not supported"),
    ({"messages": []}, "at least one message"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "not supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "belong in assistant messages"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_input_is_400_in_anthropic_shape(client, fields, message):
    body = {"model": MODEL, "max_tokens": 5, "messages": ASK, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=httpx.Response, body=body)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert message in err["error"]["message"], err
    assert "/tmp" not in err["error"]["message"]


def test_other_refusals_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=1, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=ASK)
    headers = {"x-api-key": "sk-a"}
    for method, path, content, status, kind in (
            ("POST", "/v1/messages", b"{not json", 400, "invalid_request_error"),
            ("GET", "/v1/messages", None, 405, "invalid_request_error"),
            ("POST", "/v1/messages/batches", b"{}", 404, "not_found_error")):
        r = httpx.request(method, server.url(path), content=content, headers=headers, timeout=30)
        assert r.status_code == status and r.json()["type"] == "error", (path, r.text)
        assert r.json()["error"]["type"] == kind and set(r.json()["error"]) == {"type", "message"}
    big = b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "' + b"x" * (10 * 10**6) + b'"}]}'
    r = httpx.post(server.url("/v1/messages"), content=big, headers=headers, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


# ---- conversion and block order, without a server ----------------------------------------------------------------------
def test_blocks_become_chat_messages_in_order():
    from tokenmill.serve.anthropic.convert import chat_request, conversation
    from tokenmill.serve.anthropic.protocol import MessagesRequest

    req = MessagesRequest.model_validate({"max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
                                          "tools": [WEATHER], "tool_choice": {"type": "any",
                                                                              "disable_parallel_tool_use": True},
                                          "messages": [
        ASK[0],
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris", "unit": "c"}}]},
        {"role": "user", "content": [{"type": "text", "text": "Before."},
                                     {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "down"}]},
                                     {"type": "text", "text": "After."}]},
        {"role": "assistant", "content": "It is"}]})
    chat = chat_request(req, conversation(req))
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", ASK[0]["content"]), ("assistant", "Let me look."), ("user", "Before."),
        ("tool", "Error: down"), ("user", "After."), ("assistant", "It is")]
    call = chat.messages[2].tool_calls[0]
    assert call["id"] == "t1" and json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert chat.messages[4].tool_call_id == "t1" and chat.messages[4].name == "get_weather"
    assert chat.continue_final_message and not chat.add_generation_prompt  # the prefill is continued
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                                            "description": WEATHER["description"]}}]


def test_stream_blocks_open_and_close_in_turn():
    from tokenmill.serve.anthropic.stream import BlockWriter
    from tokenmill.serve.chat_output import ChoiceParts
    from tokenmill.serve.protocol import DeltaFunctionCall, DeltaToolCall

    def call(index, arguments, name=None):
        return DeltaToolCall(index=index, id=f"c{index}" if name else None,
                             function=DeltaFunctionCall(name=name, arguments=arguments))

    w = BlockWriter()
    events = (w.parts(ChoiceParts(reasoning="think")) + w.parts(ChoiceParts(reasoning="ing", content="Hi")) +
              w.parts(ChoiceParts(tool_calls=[call(0, '{"a"', "f"), call(0, ": 1}")])) +
              w.parts(ChoiceParts(tool_calls=[call(1, "{}", "g")])) + w.close())
    seen = [(json.loads(e.split("\n")[1][len("data: "):])) for e in events]
    assert [(e["type"], e["index"]) for e in seen] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3)]
    assert [e["content_block"]["type"] for e in seen if e["type"] == "content_block_start"] == [
        "thinking", "text", "tool_use", "tool_use"]
    assert "".join(e["delta"]["partial_json"] for e in seen if e["type"] == "content_block_delta" and e["index"] == 2) \
        == '{"a": 1}'
