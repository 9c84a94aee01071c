"""A StructuredOutputsParams -> llguidance's grammar text, and checking it before a request is admitted.

Both run on the caller's side (the processor): a bad schema, regex or grammar is a 400 naming the problem,
never a request that dies in the engine. Compiling against the tokenizer (the matcher) happens in the core.
"""
from __future__ import annotations

import concurrent.futures
import json

from tokenmill.sampling_params import StructuredOutputsParams

# A grammar's source text beyond this is refused (400): a schema that large is an attack or a mistake,
# and llguidance's own limits (LLParserLimits) bound what compiles within it.
MAX_GRAMMAR_BYTES = 256 * 1024
# Checking a grammar runs in a thread with this timeout, so a pathological one answers 400, not a hang.
VALIDATE_TIMEOUT_S = 10.0

# Whitespace allowed between JSON tokens: none, one space, or one newline and up to 16 characters of
# indentation, which covers compact and pretty-printed JSON. Unbounded whitespace (JSON's own grammar) lets a
# weak model pad forever and run out of max_tokens before the closing brace. disable_any_whitespace: none.
JSON_WHITESPACE = r"(\n[ \t]{0,16}| )?"

_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - llguidance is a dependency
        raise ValueError(f"structured outputs need the llguidance package ({e}).") from None
    return llguidance


def to_grammar(so: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the constraint. ValueError when the input is not even well formed."""
    llg = _llg()
    M = llg.LLMatcher
    kind, text = so.spec()
    if len(text) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"structured output {kind.split(':')[0]} is {len(text)} bytes; "
                         f"the limit is {MAX_GRAMMAR_BYTES}.")
    options = {"whitespace_flexible": False} if so.disable_any_whitespace else {"whitespace_pattern": JSON_WHITESPACE}
    if kind.startswith("json_object"):
        return M.grammar_from_json_schema({"type": "object"}, overrides=options)
    if kind.startswith("json"):
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}.")
        return M.grammar_from_json_schema(schema, overrides=options)
    if kind == "regex":
        return M.grammar_from_regex(text)
    if kind == "choice":
        # Each choice is a literal: quote it for Lark.
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    if kind == "grammar":
        try:
            return llg.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise ValueError(str(e)) from None
    if kind == "structural_tag":
        return _structural_tag(llg, json.loads(text))
    raise ValueError(f"unknown structured output kind {kind!r}.")


def _structural_tag(llg, spec: dict) -> str:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text in
    which each `begin` (which starts with one of the triggers) is followed by JSON valid for its schema."""
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or not spec["structures"]:
        raise ValueError('structural_tag needs a non-empty "structures" list.')
    triggers = spec.get("triggers") or []
    tags = []
    for i, s in enumerate(spec["structures"]):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str):
            raise ValueError(f'structural_tag.structures[{i}] needs a "begin" string.')
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structural_tag.structures[{i}].begin {s['begin']!r} starts with none of the triggers.")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema") or {"type": "object"},
                                  end=s.get("end", "")))
    return llg.StructTag.to_grammar(tags)


_checked: dict[tuple[str, str], str] = {}  # spec -> error ("" valid): the server checks, then the processor


def validate(so: StructuredOutputsParams) -> str:
    """Check the constraint compiles (without the tokenizer); returns the grammar text or raises ValueError."""
    grammar = to_grammar(so)
    key = so.spec()
    error = _checked.get(key)
    if error is None:
        error = _check(grammar)
        if len(_checked) >= 1024:
            _checked.pop(next(iter(_checked)))
        _checked[key] = error
    if error:
        raise ValueError(f"invalid {so.kind.replace('_', ' ')} constraint: {error.strip()}")
    return grammar


def _check(grammar: str) -> str:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")
    future = _pool.submit(_llg().LLMatcher.validate_grammar, grammar)
    try:
        return future.result(timeout=VALIDATE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        return f"it did not compile within {VALIDATE_TIMEOUT_S:g} s."
