"""A StructuredOutputsParams -> llguidance's grammar text, and checking it before a request is admitted.

Both run on the caller's side (the processor): a bad schema, regex or grammar is a 400 naming the problem,
never a request that dies in the engine. Compiling against the tokenizer (the matcher) happens in the core,
which gets its grammar text from `to_grammar` too: the limits (checker.py) hold on both paths.
"""
from __future__ import annotations

import json
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output import checker

# A grammar's source text beyond this is refused (400): a schema that large is an attack or a mistake,
# and llguidance's own limits (LLParserLimits) bound what compiles within it.
MAX_GRAMMAR_BYTES = 256 * 1024
# Checking a grammar runs in a worker process with this timeout, so a pathological one answers 400, not a hang.
VALIDATE_TIMEOUT_S = 10.0

# Whitespace allowed between JSON tokens: none, one space, or one newline and up to 16 characters of
# indentation, which covers compact and pretty-printed JSON. Unbounded whitespace (JSON's own grammar) lets a
# weak model pad forever and run out of max_tokens before the closing brace. disable_any_whitespace: none.
JSON_WHITESPACE = r"(\n[ \t]{0,16}| )?"

# Numbers a schema leaves unbounded get bounds, for the same reason: a weak model otherwise writes digits
# until max_tokens (a 190-digit integer) and the JSON never closes. The bounds are what a JSON parser keeps:
# - integers: the int64 range, at most 19 digits. llguidance holds bounds as f64 and cannot build the range up
#   to 2**63 - 1 itself; 2**63 - 1024 is the largest f64 below it.
# - numbers: |x| <= 10**15 (every integer up to there is exact in a double) with at most 10 digits after the
#   point (llguidance's multipleOf takes no finer step). llguidance writes no exponent for a bounded number.
JSON_INT_BOUND = 2**63 - 1024
JSON_NUMBER_BOUND = 10**15
JSON_NUMBER_STEP = 1e-10
# Keywords whose values are data, not subschemas: never given bounds.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "x-guidance"})


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - llguidance is a dependency
        raise ValueError(f"structured outputs need the llguidance package ({e}).") from None
    return llguidance


def spec(so: StructuredOutputsParams) -> tuple[str, str]:
    """so.spec(), with a schema nested deeper than Python serializes a ValueError (a 400), not a RecursionError."""
    try:
        return so.spec()
    except RecursionError:  # a dict schema nested deeper than json.dumps goes
        raise ValueError(f"the structured output constraint nests more than {checker.MAX_JSON_NESTING} deep; "
                         f"the limit is {checker.MAX_JSON_NESTING}.") from None


def to_grammar(so: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the constraint. ValueError when the input is not even well formed or is
    over a limit (checker.py): llguidance never sees a grammar that could crash its compile."""
    llg = _llg()
    M = llg.LLMatcher
    kind, text = spec(so)
    if len(text) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"structured output {kind.split(':')[0]} is {len(text)} bytes; "
                         f"the limit is {MAX_GRAMMAR_BYTES}.")
    options = {"whitespace_flexible": False} if so.disable_any_whitespace else {"whitespace_pattern": JSON_WHITESPACE}
    if kind.startswith("json_object"):
        return M.grammar_from_json_schema(any_json_object(), overrides=options)
    if kind.startswith("json"):
        schema = _load_json(text, "the JSON schema")
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}.")
        checker.check_json_schema(schema)
        return M.grammar_from_json_schema(bound_numbers(schema), overrides=options)
    if kind == "regex":
        checker.check_regex(text)
        return M.grammar_from_regex(text)
    if kind == "choice":
        # Each choice is a literal: quote it for Lark.
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    if kind == "grammar":
        checker.check_grammar_text(text)
        try:
            return llg.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise ValueError(str(e)) from None
    if kind == "structural_tag":
        return _structural_tag(llg, _load_json(text, "structural_tag"))
    raise ValueError(f"unknown structured output kind {kind!r}.")


def _load_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{what} nests more than {checker.MAX_JSON_NESTING} deep; "
                         f"the limit is {checker.MAX_JSON_NESTING}.") from None


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
        schema = s.get("schema") or {"type": "object"}
        checker.check_json_schema(schema, f"the schema of structural_tag.structures[{i}]")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=bound_numbers(schema),
                                  end=s.get("end", "")))
    return llg.StructTag.to_grammar(tags)


# ---- bounded numbers ------------------------------------------------------------------------------------
def _int_bounds() -> dict:
    return {"minimum": -JSON_INT_BOUND, "maximum": JSON_INT_BOUND}


def _number_bounds() -> dict:
    return {"minimum": -JSON_NUMBER_BOUND, "maximum": JSON_NUMBER_BOUND, "multipleOf": JSON_NUMBER_STEP}


def bound_numbers(schema: Any) -> Any:
    """`schema` with JSON_INT_BOUND / JSON_NUMBER_BOUND / JSON_NUMBER_STEP added to every integer and number
    subschema where it sets no bound of its own on that side (modified in place; `to_grammar` parses a fresh
    copy). Values that the schema leaves open ({}, unlisted properties) keep llguidance's own number."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        _bound(node)
        todo.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS)
    return schema


def _bound(s: dict) -> None:
    types = s.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if not types & {"integer", "number"} or "const" in s or "enum" in s:
        return
    bounds = _number_bounds() if "number" in types else _int_bounds()
    low, high = s.get("minimum", s.get("exclusiveMinimum")), s.get("maximum", s.get("exclusiveMaximum"))
    if "minimum" not in s and "exclusiveMinimum" not in s and not _beyond(high, bounds["minimum"], False):
        s["minimum"] = bounds["minimum"]
    if "maximum" not in s and "exclusiveMaximum" not in s and not _beyond(low, bounds["maximum"], True):
        s["maximum"] = bounds["maximum"]
    if "multipleOf" in bounds and "multipleOf" not in s:
        s["multipleOf"] = bounds["multipleOf"]


def _beyond(value: Any, bound: float, greater: bool) -> bool:
    """Whether the schema's own bound on the other side lies beyond ours (adding ours would leave nothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value > bound if greater else value < bound


def any_json_object() -> dict:
    """`json_object`: any JSON object, its numbers bounded as in bound_numbers (llguidance's own "any" value
    has unbounded numbers)."""
    value = {"$ref": "#/$defs/value"}
    return {"$defs": {"value": {"anyOf": [
        {"type": "null"}, {"type": "boolean"}, {"type": "integer", **_int_bounds()},
        {"type": "number", **_number_bounds()}, {"type": "string"},
        {"type": "array", "items": value}, {"type": "object", "additionalProperties": value}]}},
        "type": "object", "additionalProperties": value}


# ---- the check ------------------------------------------------------------------------------------------
_checked: dict[tuple[str, str], str] = {}  # spec -> error ("" valid): the server checks, then the processor


def validate(so: StructuredOutputsParams) -> str:
    """Check the constraint compiles (without the tokenizer); returns the grammar text or raises ValueError.
    The limits are checked here; llguidance's check runs in a worker process (checker.check_isolated)."""
    grammar = to_grammar(so)
    key = spec(so)
    error = _checked.get(key)
    if error is None:
        error = checker.check_isolated(grammar, VALIDATE_TIMEOUT_S)
        if len(_checked) >= 1024:
            _checked.pop(next(iter(_checked)))
        _checked[key] = error
    if error:
        raise ValueError(f"invalid {so.kind.replace('_', ' ')} constraint: {error.strip()}")
    return grammar
