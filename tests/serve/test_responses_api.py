"""The Responses API (/v1/responses, issue 48) through `tokenmill serve` on tiny random models, driven by the
official `openai` client (`client.responses.create`, streamed and not), every answer and every stream event
validated by the SDK's own types (openai.types.responses: Response, ResponseStreamEvent, and the SDK's stream
accumulator). A random model's output is valid only if a constraint made it so: tool calls are forced with
tool_choice and JSON with text.format; the prompts are checked token for token against /tokenize of the chat
conversation they should render."""
from __future__ import annotations

import inspect
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from server_harness import start_server
from tiny import make_tiny_model

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny"
INTERNAL = "sk-internal"
KEYS = """
tenants:
  - {name: team-a, keys: [sk-a]}
  - {name: team-b, keys: [sk-b]}
  - {name: team-c, keys: [sk-c], limits: {tokens_per_day: 300}}
"""
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**6}},
          "required": ["city", "population"], "additionalProperties": False}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}
# As Qwen3's template: the generation prompt opens a <think> block (see tests/structured_output/test_server_structured.py).
THINK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")

EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    path = make_tiny_model(root / "llama", "llama", max_position_embeddings=2048)
    keys = root / "keys.yaml"
    keys.write_text(KEYS)
    srv = start_server(path, root / "server.log", "--served-model-name", MODEL, "--api-keys-file", str(keys),
                       "--internal-api-key", INTERNAL, "--kv-cache-memory-bytes", "32M", "--max-model-len", "2048",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    assert srv.stop() == 0, srv.log()


def sdk(server, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=key, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def client(server):
    return sdk(server)


def post(server, body: dict, key: str = "sk-a") -> httpx.Response:
    return httpx.post(server.url("/v1/responses"), json={"model": MODEL, **body}, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def checked(r) -> Response:
    """The SDK builds its objects without validating them: validate what came back against its types."""
    return Response.model_validate(r.to_dict() if hasattr(r, "to_dict") else r)


def events_of(stream) -> list:
    """Every event of a stream, each validated by the SDK's types and fed through the SDK's own accumulator (which
    checks that items are added before their deltas and done before the response completes); numbered 0, 1, ..."""
    from openai.lib.streaming.responses._responses import ResponseStreamState

    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    events = []
    for e in stream:
        EVENT.validate_python(e.to_dict(warnings=False))
        state.handle_event(e)
        events.append(e)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert all(e.response.id == events[0].response.id for e in events if hasattr(e, "response"))
    return events


def tokens(server, messages: list[dict]) -> int:
    """How many tokens the chat template renders these messages to (the server's /tokenize)."""
    r = httpx.post(server.url("/tokenize"), json={"model": MODEL, "messages": messages}, timeout=30,
                   headers={"Authorization": "Bearer sk-a"})
    assert r.status_code == 200, r.text
    return r.json()["count"]


# ---- text, usage, max_output_tokens -------------------------------------------------------------------------
def test_text_response_usage_and_max_output_tokens(server, client):
    r = client.responses.create(model=MODEL, input="Tell me about Paris.", instructions="Be brief.",
                                max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    resp = checked(r)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.object == "response" and resp.model == MODEL and resp.id.startswith("resp_")
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 8 and resp.temperature == 0
    [msg] = resp.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "incomplete"
    assert r.output_text and msg.content[0].text == r.output_text
    u = resp.usage
    assert u.output_tokens == 8 and u.total_tokens == u.input_tokens + 8
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0
    # instructions are the system message, before the input
    assert u.input_tokens == tokens(server, [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Tell me about Paris."}])


def test_stream_events_and_the_same_text(client):
    kw = dict(model=MODEL, input="Tell me about Paris.", max_output_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.responses.create(**kw)
    events = events_of(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = "".join(d.delta for d in deltas)
    assert text == whole.output_text == events[-4].text
    final = checked(events[-1].response)
    assert final.status == "incomplete" and final.output[0].content[0].text == text
    assert final.usage.output_tokens == 10
    item_ids = {e.item_id for e in deltas} | {events[2].item.id, events[-2].item.id}
    assert item_ids == {final.output[0].id}


# ---- structured output ---------------------------------------------------------------------------------------
def test_json_schema_output(client):
    r = client.responses.create(model=MODEL, input="A city, as JSON.", text=JSON_FORMAT, temperature=1.0,
                                max_output_tokens=200, extra_body={"seed": 3})
    resp = checked(r)
    assert resp.status == "completed" and resp.text.format.type == "json_schema" and resp.text.format.name == "city"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    # Streamed, through the SDK's helper (which accumulates the events into the final response).
    with client.responses.stream(model=MODEL, input="A city, as JSON.", text=JSON_FORMAT, temperature=1.0,
                                 max_output_tokens=200, extra_body={"seed": 3}) as stream:
        events = events_of(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed" and final.output_text == r.output_text

    class City(BaseModel):
        name: str = Field(max_length=12)
        founded: int = Field(ge=0, le=2100)

    parsed = client.responses.parse(model=MODEL, input="A city.", text_format=City, temperature=1.0,
                                    max_output_tokens=200, extra_body={"seed": 5})
    assert isinstance(parsed.output_parsed, City) and 0 <= parsed.output_parsed.founded <= 2100


# ---- tools -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_two_turn_tool_call(server, client, stream):
    first_kw = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], temperature=1.0,
                    max_output_tokens=200, extra_body={"seed": 3},
                    tool_choice={"type": "function", "name": "get_weather"} if stream else "required")
    if stream:
        events = events_of(client.responses.create(stream=True, **first_kw))
        first = checked(events[-1].response)
        pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert pieces == done.arguments
        assert [e.type for e in events[2:3]] == ["response.output_item.added"]
    else:
        first = checked(client.responses.create(**first_kw))
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert (first.tool_choice.to_dict() if stream else first.tool_choice) == first_kw["tool_choice"]
    assert first.tools[0].name == "get_weather"

    result = json.dumps({"temperature": 21, "unit": "c"})
    second = checked(client.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=6, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
        extra_body={"ignore_eos": True}))
    assert second.previous_response_id == first.id
    assert {o.type for o in second.output} <= {"message"} and second.usage.output_tokens == 6
    # The chain: the first input, its function call (an assistant turn) and the call's output as a tool message.
    assert second.usage.input_tokens == tokens(server, [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}])


def test_tool_call_in_input_items_and_messages(server, client):
    """Without previous_response_id: the whole conversation as input items (messages with text parts, a
    function_call and its output), developer as system."""
    items = [{"role": "developer", "content": "Answer in French."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                          {"type": "input_text", "text": "in Paris?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "unit": "c"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}]
    r = checked(client.responses.create(model=MODEL, input=items, max_output_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True}))
    assert r.usage.input_tokens == tokens(server, [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}])


# ---- the store --------------------------------------------------------------------------------------------
def test_previous_response_chains_input_and_output(server, client):
    first = client.responses.create(model=MODEL, input="Hello.", instructions="Be brief.", max_output_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    # The previous input and output come first; its instructions do not carry over.
    assert second.usage.input_tokens == tokens(server, [
        {"role": "user", "content": "Hello."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    third = client.responses.create(model=MODEL, input="Last.", previous_response_id=second.id, max_output_tokens=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert third.usage.input_tokens == tokens(server, [
        {"role": "user", "content": "Hello."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Last."}])
    assert third.usage.input_tokens_details.cached_tokens > 0  # the chain's prefix is in the prefix cache


def test_get_and_delete_stored_responses(server, client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, metadata={"run": "7"})
    got = client.responses.retrieve(r.id)
    assert checked(got).id == r.id and got.output_text == r.output_text and got.metadata == {"run": "7"}
    assert got.to_dict() == r.to_dict()
    # A streamed response is stored as its last event shows it.
    events = events_of(client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True))
    assert client.responses.retrieve(events[-1].response.id).to_dict() == events[-1].response.to_dict()
    deleted = httpx.delete(server.url(f"/v1/responses/{r.id}"), headers={"Authorization": "Bearer sk-a"})
    assert deleted.status_code == 200 and deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.create(model=MODEL, input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    client.responses.delete(events[-1].response.id)  # the SDK's delete: no body to read


def test_store_false_is_not_retrievable(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert checked(r).store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_another_tenants_response_is_unknown(server, client):
    mine = client.responses.create(model=MODEL, input="secret", max_output_tokens=3)
    other = sdk(server, "sk-b")

    def error(method: str, rid: str, key: str) -> dict:
        r = httpx.request(method, server.url(f"/v1/responses/{rid}"), headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 404
        return {**r.json()["error"], "message": r.json()["error"]["message"].replace(rid, "ID")}

    unknown = "resp_" + "0" * 32
    for method in ("GET", "DELETE"):
        assert error(method, mine.id, "sk-b") == error(method, unknown, "sk-b")  # the same answer as no such id
    chained = post(server, {"input": "x", "previous_response_id": mine.id}, key="sk-b")
    missing = post(server, {"input": "x", "previous_response_id": unknown}, key="sk-b")
    assert chained.status_code == missing.status_code == 404
    assert chained.json()["error"]["message"].replace(mine.id, "ID") == \
        missing.json()["error"]["message"].replace(unknown, "ID")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    assert client.responses.retrieve(mine.id).id == mine.id  # still there for its owner


# ---- tenants: limits and metering as on chat completions ------------------------------------------------------
def test_tenant_limits_and_counters(server):
    def value(text: str, name: str, labels: str) -> float:
        for line in text.splitlines():
            if line.startswith(f"tokenmill:{name}{{") and all(x in line for x in labels.split(",")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    metrics = lambda: httpx.get(server.url("/metrics"), headers={"Authorization": f"Bearer {INTERNAL}"}).text  # noqa
    before = metrics()
    r = post(server, {"input": "Hi", "max_output_tokens": 4, "ignore_eos": True}, key="sk-b")
    assert r.status_code == 200
    after = metrics()
    ok = 'tenant="team-b",outcome="ok"'
    assert value(after, "tenant_requests_total", ok) == value(before, "tenant_requests_total", ok) + 1
    assert (value(after, "tenant_generation_tokens_total", 'tenant="team-b"')
            - value(before, "tenant_generation_tokens_total", 'tenant="team-b"')) == 4
    # team-c may use 300 tokens a day: a request whose worst case is over that is refused before it runs.
    big = post(server, {"input": "Hi", "max_output_tokens": 1000}, key="sk-c")
    assert big.status_code == 429 and set(big.json()["error"]) == {"message", "type", "param", "code"}


# ---- refusals ------------------------------------------------------------------------------------------------
BAD = [
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user"}]}, "input.0.content"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]},
     "input.0.arguments"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tools": [{"type": "function", "description": "no name"}]}, "tools.0.name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "required", "text": JSON_FORMAT}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 5000}, "input"),  # over the context window
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "metadata": {"k": "v" * 600}}, "metadata"),
    ({"input": "a " * 40_000}, "input"),  # over --max-input-chars (32 x max_model_len)
    ({"input": [{"role": "user", "content": "x"}] * 1200}, "input"),  # many items (read in the slow lane): too long
]


@pytest.mark.parametrize("body, param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_are_400_in_openai_shape(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_other_refusals(server, client):
    r = httpx.post(server.url("/v1/responses"), headers={"Authorization": "Bearer sk-a"},
                   content=b'{"model": "tiny", "input": "\\ud800"}')  # a lone surrogate
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = post(server, {"model": "no-such-model", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_file"}]}])
    assert e.value.body["param"] == "input.0.content.0.type"
    assert post(server, {"input": "still fine", "max_output_tokens": 2}).status_code == 200


# ---- reasoning -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses-think")
    path = make_tiny_model(root / "llama", "llama", added_tokens=("<think>", "</think>"), max_position_embeddings=2048)
    template = root / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    srv = start_server(path, root / "server.log", "--served-model-name", MODEL, "--kv-cache-memory-bytes", "32M",
                       "--max-model-len", "2048", "--reasoning-parser", "deepseek_r1", "--chat-template",
                       str(template))
    yield srv
    assert srv.stop() == 0, srv.log()


def _end_id(srv) -> int:
    ids = httpx.post(srv.url("/tokenize"), json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1
    return ids[0]


def test_reasoning_items(think_server):
    c = openai.OpenAI(base_url=think_server.url("/v1"), api_key="x", timeout=120, max_retries=0)
    # No </think>: all of the output is reasoning.
    kw = dict(model=MODEL, input="What is 5 plus 5?", max_output_tokens=12, temperature=0,
              extra_body={"ignore_eos": True, "logit_bias": {str(_end_id(think_server)): -100}})
    r = checked(c.responses.create(**kw))
    [item] = r.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text" and item.content[0].text
    assert item.status == "incomplete" and r.status == "incomplete"
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12
    events = events_of(c.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == item.content[0].text
    assert checked(events[-1].response).output[0].content[0].text == item.content[0].text

    # Pushed to close its reasoning, then constrained: a reasoning item, then the JSON answer.
    kw = dict(model=MODEL, input="A city, as JSON.", text=JSON_FORMAT, max_output_tokens=300, temperature=1.0,
              extra_body={"seed": 0, "logit_bias": {str(_end_id(think_server)): 3.0}})
    r = checked(c.responses.create(**kw))
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    jsonschema.validate(json.loads(r.output[1].content[0].text), SCHEMA)
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = events_of(c.responses.create(stream=True, **kw))
    final = checked(events[-1].response)
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[1].content[0].text == r.output[1].content[0].text
    assert final.output[0].content[0].text == r.output[0].content[0].text


# ---- without a server ------------------------------------------------------------------------------------------
def test_surface_admits_through_the_one_path():
    """As tests/serve/test_admission.py pins for chat and completions: the Responses API admits through admission.py."""
    from tokenmill.serve.responses import create

    source = inspect.getsource(create)
    assert "admit(state, raw" in source and ".submit(" in source
    for step in ("tenant_of(", "resolve_model(", "slo_for(", "admit_sequences(", "check_capacity(", "Submission(",
                 "reserve_for(", "worst_case_tokens(", ".start()", "mark("):
        assert step not in source, step


def test_store_bounds_and_owners():
    from tokenmill.serve.responses.store import ResponseStore

    store = ResponseStore(max_responses=3, max_bytes=100)
    for i in range(4):
        assert store.put(f"r{i}", "a", "x" * 10, "[]")
    assert store.get("r0", "a") is None and len(store) == 3  # the oldest went first
    assert store.get("r1", "a") is not None  # r1 is now the most recently used
    assert store.put("big", "a", "x" * 60, "[]")  # bytes: 60 + 12 + 12 + 12 > 100, so the least recent go
    assert store.get("r2", "a") is None and store.get("r1", "a") is not None and store.bytes <= 100
    assert not store.put("huge", "a", "x" * 200, "[]") and store.get("huge", "a") is None
    assert store.get("r1", "b") is None and not store.delete("r1", "b") and store.get("r1", None) is None
    assert store.delete("r1", "a") and store.get("r1", "a") is None


def test_output_events_of_every_item_kind():
    """Reasoning, text and two calls in one stream (more than a tiny model writes in one test): every event
    validates, the SDK's accumulator follows them, and the items are what a whole response would hold."""
    from openai.lib.streaming.responses._responses import ResponseStreamState

    from tokenmill.serve.chat_output import ChoiceParts
    from tokenmill.serve.protocol import DeltaFunctionCall, DeltaToolCall
    from tokenmill.serve.responses.output import EventLog, OutputBuilder

    events = EventLog()
    created = {"id": "resp_1", "object": "response", "created_at": 0, "status": "in_progress", "model": "m",
               "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    events.emit("response.created", response=created)
    out = OutputBuilder(events)
    out.add(ChoiceParts(reasoning="Let me "))
    out.add(ChoiceParts(reasoning="think.", content="Checking."))
    out.add(ChoiceParts(tool_calls=[DeltaToolCall(index=0, id="call_a", type="function",
                                                  function=DeltaFunctionCall(name="f", arguments='{"x"'))]))
    out.add(ChoiceParts(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=": 1}")),
                                    DeltaToolCall(index=1, id="call_b", type="function",
                                                  function=DeltaFunctionCall(name="g", arguments="{}"))]))
    out.finish(incomplete=False)
    events.emit("response.completed", response={**created, "status": "completed",
                                                 "output": [i.model_dump() for i in out.items]})
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    parsed = [EVENT.validate_python(json.loads(e.split("data: ", 1)[1])) for e in events.take()]
    for e in parsed:
        state.handle_event(e)
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [i.type for i in out.items] == ["reasoning", "message", "function_call", "function_call"]
    assert out.items[0].content[0].text == "Let me think." and out.items[1].content[0].text == "Checking."
    assert [(i.call_id, i.name, i.arguments, i.status) for i in out.items[2:]] == [
        ("call_a", "f", '{"x": 1}', "completed"), ("call_b", "g", "{}", "completed")]
    final = checked(parsed[-1].response)
    assert final.output_text == "Checking."


def test_input_conversion():
    from tokenmill.serve.errors import APIError
    from tokenmill.serve.responses.conversation import input_messages, output_turn
    from tokenmill.serve.responses.protocol import FunctionCallItem, OutputMessage, OutputText, ReasoningItem

    calls: set[str] = set()
    msgs = input_messages([
        {"role": "developer", "content": "d"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
    ], calls)
    assert [(m.role, m.content) for m in msgs] == [("system", "d"), ("assistant", None), ("tool", "ok")]
    assert [c["id"] for c in msgs[1].tool_calls] == ["c1", "c2"] and calls == {"c1", "c2"}
    with pytest.raises(APIError):
        input_messages([{"type": "function_call_output", "call_id": "c9", "output": "x"}], calls)
    turn = output_turn([
        ReasoningItem(id="rs", content=[], status="completed"),
        OutputMessage(id="m", status="completed", content=[OutputText(text="hi")]),
        FunctionCallItem(id="fc", call_id="c3", name="f", arguments="{}", status="completed"),
        FunctionCallItem(id="fc2", call_id="c4", name="f", arguments='{"cut', status="incomplete")])
    assert turn.role == "assistant" and turn.content == "hi" and [c["id"] for c in turn.tool_calls] == ["c3"]


def test_engine_failure_mid_stream_ends_with_response_failed():
    """The engine fails after the stream started: an `error` event, then `response.failed` with what was sent so
    far; nothing is stored."""
    import asyncio
    from types import SimpleNamespace

    from tokenmill.serve.chat_output import ChatPlan
    from tokenmill.serve.errors import APIError
    from tokenmill.serve.responses.create import Answer
    from tokenmill.serve.responses.protocol import ResponsesRequest
    from tokenmill.serve.responses.store import ResponseStore

    class FailingSubmission:
        finished, aborted, calls = False, False, 0

        async def next(self):
            self.calls += 1
            if self.calls == 1:
                return SimpleNamespace(sequences=[SimpleNamespace(text="Hello", finish_reason=None)])
            raise APIError(503, "The engine is not running.", None, "engine_dead")

        def abort(self):
            self.aborted = True

    async def run(answer) -> list[str]:
        return [e async for e in answer.stream()]

    store, sub = ResponseStore(), FailingSubmission()
    answer = Answer(None, store, ResponsesRequest(input="hi"), sub, ChatPlan(), "m", None, [])
    raw = asyncio.run(run(answer))
    events = [EVENT.validate_python(json.loads(e.split("data: ", 1)[1])) for e in raw]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "error", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.failed"]
    failed = checked(events[-1].response)
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.output_text == "Hello"
    assert events[5].code == "engine_dead" and sub.aborted and len(store) == 0
