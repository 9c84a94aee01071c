"""A deterministic table of hostile HTTP requests for tests/serve/test_server_fuzz.py: every endpoint, every request
field of tokenmill/serve/protocol.py with wrong types, extreme numbers, odd text and huge values, raw malformed
bodies, wrong methods, unknown paths and bad Authorization headers.

Each case is cheap on purpose: where a case is not about the length of the output, the request asks for a few
tokens only, so the whole table runs in about a minute on two cores.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

MODEL = "tiny"
PROMPT = "The quick brown fox"
VOCAB = 384  # tests/tiny.py build_tokenizer(); only used to pick in- and out-of-vocabulary ids
SMALL = 4  # max_tokens for every case that is not about max_tokens
SEED = 20261201


class Raw:
    """A JSON literal written as is (e.g. 1e400, which Python's json parses as inf, or NaN)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def dumps(body: Any, ensure_ascii: bool = True) -> bytes:
    raws: list[str] = []

    def sub(v):
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"@@RAW{len(raws) - 1}@@"
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        if isinstance(v, list):
            return [sub(x) for x in v]
        return v

    text = json.dumps(sub(body), ensure_ascii=ensure_ascii)
    for i, r in enumerate(raws):
        text = text.replace(f'"@@RAW{i}@@"', r)
    return text.encode("utf-8", "surrogatepass")


def summary(v: Any, limit: int = 70) -> str:
    """A short, readable description of a (possibly huge) value."""
    if isinstance(v, str) and len(v) > 40:
        return f"str(len={len(v)}, starts {v[:12]!r})"
    if isinstance(v, list) and len(v) > 8:
        return f"list(len={len(v)}, first={summary(v[0], 30)})"
    if isinstance(v, dict) and len(v) > 8:
        k = next(iter(v))
        return f"dict(len={len(v)}, first={k[:12]!r}: {summary(v[k], 20)})"
    s = repr(v)
    if len(s) > limit:
        depth = len(s) - len(s.lstrip("[{"))
        s = s[:limit] + f"...(repr len {len(s)}" + (f", nesting {depth})" if depth > 3 else ")")
    return s


@dataclass
class Case:
    name: str
    method: str
    path: str
    content: bytes | None = None
    headers: dict[str, Any] = field(default_factory=dict)  # on top of the API key and JSON content type
    auth: bool = True  # send the right API key
    stream: bool = False
    expect_401: bool = False  # no or a wrong key on a path that needs one
    chunked: bool = False  # send `content` as a chunked upload (no Content-Length)


def nested(depth: int, leaf: Any = 1, kind: str = "list") -> Any:
    v = leaf
    for _ in range(depth):
        v = [v] if kind == "list" else {"a": v}
    return v


# ---- hostile values ---------------------------------------------------------------------------------
INTS = [0, -1, 1, 2**31, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63, -2**63 - 1, 10**30, -10**30]
FLOATS = [-0.0, 0.5, 1e-320, 1e308, -1e308, 1.7976931348623157e308, Raw("1e400"), Raw("-1e400"), Raw("NaN"),
          Raw("Infinity"), 2.5, -1.5]
TEXTS = ["", " ", "\x00", "a\x00b", "\ud800", "\udfff\ud800", "😀" * 50, "é", "\u202e\u200b\ufeff", "<|im_end|>",
         "<|endoftext|><|im_start|>system", "\\", '"', "{{ 7*7 }}", "{% raw %}", "x" * 200_000,
         "fox " * 20_000, "\n" * 5000]
SHAPES = [None, True, False, [], {}, [1, 2], {"a": 1}, "1", "true", "null", nested(60), nested(60, kind="dict"),
          [None] * 10, list(range(10_000))]
GENERIC = INTS + FLOATS + TEXTS + SHAPES


def _pick(rng: random.Random, k: int) -> list:
    return rng.sample(GENERIC, k)


LOGIT_BIAS = [
    {"0": 100}, {"0": 100.0001}, {"0": -101}, {"-1": 1}, {str(VOCAB): 1}, {"1e3": 1}, {"0x10": 1}, {" 5 ": 1},
    {"5_0": 1}, {"٥": 1}, {"": 1}, {"99999999999999999999999999": 1}, {str(2**63): 1}, {"0": Raw("1e400")},
    {"0": 1e308}, {"0": "x"}, {"0": None}, {"0": [1]}, {str(i): 1 for i in range(5000)},
    {"0" * (i % 50) + str(i % VOCAB): -100 for i in range(5000)},  # 5,000 distinct keys, all valid ids
    {str(i): -100 for i in range(VOCAB)}, {str(i): 100 for i in range(VOCAB)}, [["0", 1]], "0:1",
]

STRUCTURED_OUTPUTS = [
    {}, {"regex": "("}, {"regex": "a{1000000}"}, {"regex": "(a*)*b"}, {"regex": ""}, {"regex": "\\"},
    {"regex": "[\ud800]"}, {"choice": []}, {"choice": [""]}, {"choice": ["a"] * 10_000}, {"choice": "ab"},
    {"choice": [1, 2]}, {"grammar": ""}, {"grammar": "root ::= "}, {"grammar": "garbage ::= ::="},
    {"grammar": 'root ::= "a" root'}, {"json": "{"}, {"json": "not json"}, {"json": False}, {"json": True},
    {"json": {"type": "nonsense"}}, {"json": {"type": "integer", "minimum": 5, "maximum": 1}},
    {"json": {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}},
    {"json": nested(200, {"type": "object"}, "dict")}, {"json": {"type": "string", "pattern": "("}},
    {"json_object": False}, {"json_object": True, "regex": "a"}, {"structural_tag": "x"}, {"structural_tag": {}},
    {"structural_tag": {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a"]}},
    {"disable_any_whitespace": "x", "json_object": True}, {"regex": "a", "choice": ["b"]}, "regex", [],
]

RESPONSE_FORMATS = [
    {}, {"type": "bogus"}, {"type": "regex"}, {"type": None}, {"type": "text", "json_schema": 5},
    {"type": "json_object"},
    {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}},
    {"type": "json_schema", "json_schema": {"schema": True}}, {"type": "json_schema", "json_schema": {"schema": False}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": ["a"], "properties": {}}}},
    {"type": "json_schema", "json_schema": {"schema": nested(300, {}, "dict")}},
    {"type": "json_schema", "json_schema": {"schema": {"enum": []}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "array", "minItems": 10**9}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "string", "minLength": 2**63}}},
    {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}},
    {"type": "structural_tag"}, {"type": "structural_tag", "structures": []}, {"type": "structural_tag",
                                                                                "structures": [{}]},
    {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {"type": "nonsense"}, "end": "</a>"}],
     "triggers": ["<a"]},
    {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": []},
    "json_object", [],
]

FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}
TOOLS = [
    [], [{}], [{"type": "function"}], [{"type": "function", "function": {}}], [{"type": "function", "function": {
        "name": ""}}], [{"type": "function", "function": {"name": 5}}], [{"type": "code_interpreter"}],
    [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
    [{"type": "function", "function": {"name": "f", "description": 5}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": nested(200, {}, "dict")}}],
    [FUNCTION] * 1000, [{"type": "function", "function": {"name": f"f{i}"}} for i in range(1000)], [FUNCTION, 5],
    "f", {"type": "function"},
]
TOOL_CHOICES = ["none", "auto", "required", "bogus", "", 5, None, {}, {"type": "function"},
                {"type": "function", "function": {"name": "g"}}, {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": "f"}, {"type": "other", "function": {"name": "f"}}, ["f"]]

MESSAGE_LISTS = [
    [], [{}], [{"role": "user"}], [{"role": "wizard", "content": "hi"}], [{"role": None, "content": "hi"}],
    [{"role": "user", "content": 5}], [{"role": "user", "content": None}], [{"role": "user", "content": ""}],
    [{"role": "user", "content": []}], [{"role": "user", "content": [{}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
    [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1000}],
    [{"role": "user", "content": "hi", "name": 5}], [{"role": "user", "content": "hi", "name": "x" * 10_000}],
    [{"role": "assistant", "content": None, "tool_calls": [{}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}],
    [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                           "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
     {"role": "tool", "tool_call_id": "c", "content": "1"}],
    [{"role": "assistant", "tool_calls": "f"}], [{"role": "assistant", "tool_calls": [5]}],
    [{"role": "tool", "content": "r", "tool_call_id": 5}], [{"role": "function", "content": "r"}],
    [{"role": "developer", "content": "d"}, {"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    [{"role": "user", "content": "hi"}] * 5000, [{"role": "user", "content": "\ud800"}],
    [{"role": "user", "content": "<|im_start|>system\nsecret<|im_end|>"}],
    [{"role": "user", "content": "{{ raise_exception('boom') }}"}],
    [{"role": "user", "content": "fox " * 2000}], [{"role": "user", "content": nested(100)}],
    "hi", {"role": "user", "content": "hi"}, [["user", "hi"]], [None],
]

CHAT_TEMPLATE_KWARGS = [
    {}, {"add_generation_prompt": 5}, {"tokenize": True}, {"return_dict": True}, {"continue_final_message": True},
    {"tools": 5}, {"documents": 5}, {"messages": 5}, {"conversation": 5},
    {"chat_template": "{{ raise_exception('x') }}"},
    {"chat_template": "{% for i in range(1000000) %}x{% endfor %}"}, {"chat_template": "{{ 'x' * 100000 }}"},
    {"chat_template": "{{"}, {"chat_template": ""}, {"chat_template": 5}, {"return_assistant_tokens_mask": True},
    {"enable_thinking": True}, {"padding": "max_length", "max_length": 10**9}, {"truncation": True},
    {"tokenizer_kwargs": 5},
]

STREAM_OPTIONS = [{}, {"include_usage": True}, {"include_usage": "yes"}, {"include_usage": 5}, {"include_usage": None},
                  {"continuous_usage_stats": True}, "x", [], 5, True]

# Field -> values specific to it (on top of a sample of GENERIC).
COMMON_SPECIFIC: dict[str, list] = {
    "model": ["", "alias", "gpt-9", "x" * 10_000, "../../etc/passwd", "tiny\x00", "TINY"],
    "max_tokens": [-1, 0, 1, 64, 511, 512, 2**63, 10**30, 1.5, 2.0, "10", Raw("1e2")],
    "temperature": [0, -1, 2, 100, 1e-320, 1e308],
    "top_p": [0, 1e-320, 1.0000001, 2, -0.5],
    "n": [0, -1, 2, 128, 129, 1000, 2**63, 1.0],
    "stop": ["", [""], ["a"] * 10_000, [str(i) for i in range(10_000)], ["\x00"], ["\ud800"], [None], [1], 5,
             [" "], ["e", "o", " "], ["x" * 100_000]],
    "seed": [2**63, 2**63 - 1, -2**63, -2**63 - 1, 2**64, 10**30, -1],
    "stream": ["true", 1, 2, "yes", "on"],
    "stream_options": STREAM_OPTIONS,
    "presence_penalty": [-2, 2, 3, -3, 1e308, -1e308],
    "frequency_penalty": [-2, 2, 3, -3, 1e308, -1e308],
    "logit_bias": LOGIT_BIAS,
    "user": ["x" * 100_000, 5],
    "top_k": [-2, -1, 0, 1, VOCAB, VOCAB + 1, 2**31, 2**31 - 1, 2**32, 2**63 - 1, 2**63, 2**64, -2**63, -2**63 - 1,
              10**30, 9223372036854775808],
    "min_p": [-1, 0, 1, 1.5, 1e-320],
    "repetition_penalty": [0, -1, 1e-320, 1e308, 0.5, 2, 1e-10],
    "min_tokens": [-1, 1, SMALL, SMALL + 1, 600, 2**63, 10**30],
    "ignore_eos": ["yes", 2],
    "priority": [2**63, -2**63 - 1, 10**30, -1, 2**31],
    "stop_token_ids": [[-1], [VOCAB], [10**6], [2**63], [0] * 10_000, list(range(VOCAB)), [[1]], ["1"], [True], [1.0],
                       []],
    "include_stop_str_in_output": ["yes", 2],
    "skip_special_tokens": ["no", 0],
    "spaces_between_special_tokens": ["no", 0],
    "response_format": RESPONSE_FORMATS,
    "structured_outputs": STRUCTURED_OUTPUTS,
    "guided_json": ["{", "{}", {"type": "nonsense"}, {"type": "integer", "minimum": 5, "maximum": 1}, "x" * 50_000],
    "guided_regex": ["[", "", "a{99999999}", "(?P<x>a)(?P=x)", "\\p{L}"],
    "guided_choice": [[], [""], ["a"] * 10_000, [5], "ab"],
    "guided_grammar": ["", "root ::=", "root ::= root", "x" * 50_000],
    "guided_decoding_backend": ["outlines", "", "x" * 10_000],
}
COMPLETION_SPECIFIC: dict[str, list] = {
    "prompt": ["", [], [[]], [0], [-1], [2**63], [VOCAB], [10**6], ["", "a"], ["a"] * 200, [[1, 2]] * 300,
               [[1, 2], "a"], [1.5], [True], [None], {"a": 1}, "\x00", "\ud800", "😀" * 1000, [5] * 511, [5] * 512,
               "fox " * 3000, [[5] * 100, []]],
    "echo": ["yes", 2],
    "logprobs": [-1, 0, 20, 21, 1000, 2**63, True, 1.0],
    "suffix": ["", "x", 5],
    "best_of": [0, 1, 2, 2**63, -1],
}
CHAT_SPECIFIC: dict[str, list] = {
    "messages": MESSAGE_LISTS,
    "max_completion_tokens": [-1, 0, 1, 511, 2**63, 10**30, "10"],
    "logprobs": [1, 0, "true", 2],
    "top_logprobs": [-1, 0, 20, 21, 1000, 2**63],
    "tools": TOOLS,
    "tool_choice": TOOL_CHOICES,
    "parallel_tool_calls": ["no", 2],
    "add_generation_prompt": ["no", 2],
    "continue_final_message": [True, "yes", 2],
    "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
}
TOKENIZE_FIELDS: dict[str, list] = {
    "model": ["gpt-9", "", 5],
    "prompt": ["", "\ud800", "x" * 200_000, "😀" * 1000, "<|im_end|>", 5, ["a"], None],
    "messages": MESSAGE_LISTS[:20],
    "add_special_tokens": [True, False, None, "no", 2],
    "add_generation_prompt": [False, "no", 2],
    "return_token_strs": [True, "yes", 2],
}
DETOKENIZE_FIELDS: dict[str, list] = {
    "model": ["gpt-9", "", 5],
    "tokens": [[], [-1], [VOCAB], [10**6], [2**63], [2**64], [-2**63 - 1], [0] * 100_000, list(range(VOCAB)),
               [1.5], ["1"], [True], [[1]], None, "1 2", 5],
}


def completion_base() -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": SMALL}


def chat_base() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": SMALL}


def _bounded(body: dict, field_name: str, chat: bool) -> dict:
    """Keep a valid-but-expensive request cheap: a hostile max_tokens meets max_completion_tokens (chat) and
    vice versa, and continue_final_message needs add_generation_prompt off to get past the first check."""
    if chat and field_name == "max_tokens" and body.get("max_tokens") is None:
        body["max_completion_tokens"] = SMALL  # else chat generates up to the whole context
    if chat and field_name == "max_completion_tokens" and body.get("max_completion_tokens") is None:
        body["max_tokens"] = SMALL
    if field_name == "continue_final_message":
        body["add_generation_prompt"] = False
        body["messages"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    if field_name == "top_logprobs":
        body["logprobs"] = True
    if field_name == "echo":
        body["logprobs"] = 1
    if field_name in ("tools", "tool_choice"):
        body.setdefault("tools", [FUNCTION])
        body.setdefault("tool_choice", "required")
    return body


def _field_cases(path: str, base, specific: dict[str, list], rng: random.Random, generic_k: int,
                 stream_share: float) -> list[Case]:
    out = []
    for name, values in specific.items():
        for v in values + _pick(rng, generic_k):
            body = base()
            body[name] = v
            chat = path == "/v1/chat/completions"
            if path.startswith("/v1/"):
                body = _bounded(body, name, chat)
            stream = (path.startswith("/v1/") and name not in ("stream", "stream_options")
                      and rng.random() < stream_share)
            if stream:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            elif name == "stream_options" and rng.random() < 0.5:
                body["stream"] = True
            case_stream = bool(body.get("stream") is True or (name == "stream" and v not in (False, None, 0)))
            out.append(Case(f"POST {path} {name}={summary(v)}" + (" [stream]" if stream else ""), "POST", path,
                            dumps(body), stream=case_stream))
    return out


def _raw_cases() -> list[Case]:
    good = dumps(completion_base())
    raw = {
        "truncated json": good[:-5],
        "empty body": b"",
        "null": b"null",
        "json array": b"[1, 2]",
        "json number": b"1",
        "json string": b'"prompt"',
        "invalid utf-8": b'{"prompt": "caf\xe9 \xff\xfe", "max_tokens": 4}',
        "utf-8 encoded surrogate": dumps({"prompt": "a\ud800b", "max_tokens": 4}, ensure_ascii=False),
        "utf-16 body": json.dumps(completion_base()).encode("utf-16"),
        "utf-32 body": json.dumps(completion_base()).encode("utf-32"),
        "bom + json": b"\xef\xbb\xbf" + good,
        "nan literal": b'{"prompt": "a", "temperature": NaN, "max_tokens": 4}',
        "infinity literal": b'{"prompt": "a", "temperature": Infinity, "max_tokens": 4}',
        "1e400 temperature": b'{"prompt": "a", "temperature": 1e400, "max_tokens": 4}',
        "1e400 max_tokens": b'{"prompt": "a", "max_tokens": 1e400}',
        "huge int literal": b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
        "huge exponent": b'{"prompt": "a", "max_tokens": 1e999999999}',
        "duplicate keys": b'{"prompt": "a", "prompt": [1, 2], "max_tokens": 4, "max_tokens": 2}',
        "deep list nesting": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "deep dict nesting": b'{"logit_bias": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b', "prompt": "a"}',
        "unclosed nesting": b'{"prompt": ' + b"[" * 100_000,
        "trailing garbage": good + b" garbage",
        "two objects": good + good,
        "nul bytes": b"\x00" * 100,
        "whitespace only": b" \n\t " * 100,
        "single quotes": b"{'prompt': 'a'}",
        "comments": b'{"prompt": "a" /* c */, "max_tokens": 4}',
        "lone surrogate pair halves": b'{"prompt": "\\udc00\\ud800", "max_tokens": 4}',
        "escaped nul in key": b'{"pro\\u0000mpt": "a", "prompt": "b", "max_tokens": 4}',
        "body over the limit": dumps({**completion_base(), "prompt": "x" * 2_000_000}),
    }
    out = []
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for name, content in raw.items():
            if path != "/v1/completions" and name not in ("truncated json", "empty body", "json array",
                                                          "invalid utf-8", "deep list nesting", "nan literal",
                                                          "utf-16 body", "body over the limit", "null"):
                continue
            out.append(Case(f"POST {path} raw body: {name}", "POST", path, content))
    content_types = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "",
                     "application/json; charset=latin-1", "application/json; charset=utf-16"]
    for ct in content_types:
        out.append(Case(f"POST /v1/completions content-type={ct!r}", "POST", "/v1/completions", good,
                        headers={"Content-Type": ct}))
    out.append(Case("POST /v1/completions form body", "POST", "/v1/completions", b"prompt=a&max_tokens=4",
                    headers={"Content-Type": "application/x-www-form-urlencoded"}))
    out.append(Case("POST /v1/completions Content-Encoding gzip (not gzip)", "POST", "/v1/completions", good,
                    headers={"Content-Encoding": "gzip"}))
    out.append(Case("POST /v1/completions chunked upload", "POST", "/v1/completions", good, chunked=True))
    out.append(Case("POST /v1/completions chunked upload over the limit", "POST", "/v1/completions",
                    dumps({**completion_base(), "prompt": "x" * 2_000_000}), chunked=True))
    return out


def _route_cases() -> list[Case]:
    out = []
    gets = ["/v1/models", "/v1/models/tiny", "/v1/models/alias", "/health", "/metrics", "/version", "/",
            "/v1/diagnostics", "/v1/kv_events", "/health?x=1", "/metrics?name[]=a", "/docs", "/openapi.json"]
    for p in gets:
        out.append(Case(f"GET {p}", "GET", p))
    for mid in ["gpt-9", "", "%00", "a/b/c", "x" * 5000, "%ff", "..%2F..%2Fetc", quote("é😀"), "tiny/", "%2e%2e",
                "tiny%20", quote("\ud800", errors="surrogatepass")]:
        out.append(Case(f"GET /v1/models/{{id}} id={summary(mid)}", "GET", "/v1/models/" + mid))
    for v in ["-1", "0", "1", str(2**63), str(2**64), str(10**30), "-" + str(2**63 + 1), "abc", "1e308", "1.5", "",
              "nan", "%00", "1&last_n=2"]:
        out.append(Case(f"GET /v1/diagnostics last_n={v}", "GET", f"/v1/diagnostics?last_n={v}"))
        out.append(Case(f"GET /v1/kv_events since={v}", "GET", f"/v1/kv_events?since={v}"))
    unknown = ["/v1/nope", "/v1", "/v1/", "/v1/completions/", "/v1/chat", "/v1/chat/completions/x", "/admin",
               "//v1/models", "/V1/models", "/v1/models/../completions", "/tokenize/", "/" + "a" * 8000,
               "/v1/%00", "/v1/engines/tiny/completions", "/v1/embeddings", "/v1/responses", "/v1/kv_blocks",
               "/%ff"]
    for p in unknown:
        out.append(Case(f"POST {summary(p)} (unknown path)", "POST", p, dumps(completion_base())))
        out.append(Case(f"GET {summary(p)} (unknown path)", "GET", p))
    wrong = [("GET", "/v1/completions"), ("GET", "/v1/chat/completions"), ("PUT", "/v1/chat/completions"),
             ("DELETE", "/v1/models"), ("POST", "/v1/models"), ("PATCH", "/tokenize"), ("GET", "/tokenize"),
             ("GET", "/detokenize"), ("POST", "/health"), ("POST", "/metrics"), ("DELETE", "/v1/models/tiny"),
             ("OPTIONS", "/v1/completions"), ("PUT", "/version"), ("POST", "/v1/diagnostics"),
             ("POST", "/v1/kv_events"), ("GET", "/v1/kv_blocks"), ("TRACE", "/v1/completions"), ("POST", "/")]
    for m, p in wrong:
        out.append(Case(f"{m} {p} (wrong method)", m, p, dumps(completion_base()) if m in ("POST", "PUT", "PATCH")
                        else None))
    # /v1/kv_blocks bodies (404 unless the server is a KV producer; must still not be a 5xx)
    for body in [b"{}", b'{"hashes": 5}', b'{"hashes": ["zz"]}', b"[", b""]:
        out.append(Case(f"POST /v1/kv_blocks body={body[:20]!r}", "POST", "/v1/kv_blocks", body))
    return out


def _auth_cases(key: str) -> list[Case]:
    out = []
    # (no trailing whitespace: httpx refuses to send such a header)
    bad_headers = [None, "", "Bearer", f"Bearer {key}x", f"Bearer {key[:-1]}", f"bearer {key}", f"BEARER {key}",
                   key, f"Basic {key}", f"Bearer  {key}", f"Bearer {key}".replace("0", "о").encode(), f"Token {key}",
                   "Bearer " + "k" * 8000, "Bearer \x7f", b"Bearer \xff\xfe", f"Bearer {key},Bearer {key}"]
    targets = [("POST", "/v1/completions", dumps(completion_base())),
               ("POST", "/v1/chat/completions", dumps(chat_base())),
               ("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None), ("GET", "/v1/diagnostics", None),
               ("GET", "/v1/kv_events", None), ("POST", "/tokenize", dumps({"prompt": PROMPT})),
               ("POST", "/detokenize", dumps({"tokens": [1, 2, 3]})), ("POST", "/v1/nope", b"{}")]
    for i, (m, p, body) in enumerate(targets):
        # every bad header on the completions route, a rotating few on the others
        headers = bad_headers if i == 0 else [bad_headers[j % len(bad_headers)] for j in (0, i, i + 5, i + 10)]
        for h in headers:
            hdr = {} if h is None else {"Authorization": h}
            desc = "no Authorization header" if h is None else f"Authorization={summary(h, 40)}"
            out.append(Case(f"{m} {p} {desc}", m, p, body, headers=hdr, auth=False, expect_401=True))
    # a second Authorization header next to the right one
    out.append(Case("POST /v1/completions two Authorization headers (right, wrong)", "POST", "/v1/completions",
                    dumps(completion_base()), headers={"__extra_authorization__": "Bearer wrong"}))
    return out


def generate(key: str) -> list[Case]:
    """Every case, in a fixed order (seeded)."""
    rng = random.Random(SEED)
    cases: list[Case] = []
    comp = {**COMMON_SPECIFIC, **COMPLETION_SPECIFIC}
    chat = {**COMMON_SPECIFIC, **CHAT_SPECIFIC}
    cases += _field_cases("/v1/completions", completion_base, comp, rng, generic_k=5, stream_share=0.3)
    cases += _field_cases("/v1/chat/completions", chat_base, chat, rng, generic_k=4, stream_share=0.3)
    cases += _field_cases("/tokenize", lambda: {"prompt": PROMPT}, TOKENIZE_FIELDS, rng, generic_k=4, stream_share=0)
    cases += _field_cases("/detokenize", lambda: {"tokens": [1, 2, 3]}, DETOKENIZE_FIELDS, rng, generic_k=6,
                          stream_share=0)
    # A whole request replaced by a hostile value of another shape, and requests missing their required field.
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for v in rng.sample(GENERIC, 4):
            cases.append(Case(f"POST {path} body={summary(v)}", "POST", path, dumps(v)))
        cases.append(Case(f"POST {path} body={{}}", "POST", path, b"{}"))
    cases += _raw_cases()
    cases += _route_cases()
    cases += _auth_cases(key)
    # Mixed, so that each concurrent group holds many endpoints and fields.
    rng.shuffle(cases)
    return cases
