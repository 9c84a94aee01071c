"""A StructuredOutputsParams -> llguidance's grammar text, and checking it before a request is admitted.

Both run on the caller's side (the processor): a bad schema, regex or grammar is a 400 naming the problem,
never a request that dies in the engine. Compiling against the tokenizer (the matcher) happens in the core,
which gets its grammar text from `to_grammar` too: the limits (limits.py) hold on both paths.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output import isolation, limits

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
        raise ValueError(f"the structured output constraint nests more than {limits.MAX_JSON_NESTING} deep; "
                         f"the limit is {limits.MAX_JSON_NESTING}.") from None


def to_grammar(so: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the constraint. ValueError when the input is not even well formed or is
    over a limit (limits.py): llguidance never sees a grammar that could crash its compile."""
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
        limits.check_json_schema(schema)
        return M.grammar_from_json_schema(bound_numbers(schema), overrides=options)
    if kind == "regex":
        limits.check_regex(text)
        return M.grammar_from_regex(text)
    if kind == "choice":
        # Each choice is a literal: quote it for Lark.
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    if kind == "grammar":
        limits.check_grammar_text(text)
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
        raise ValueError(f"{what} nests more than {limits.MAX_JSON_NESTING} deep; "
                         f"the limit is {limits.MAX_JSON_NESTING}.") from None


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
        limits.check_json_schema(schema, f"the schema of structural_tag.structures[{i}]")
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


# ---- the check: once per distinct constraint ---------------------------------------------------------------
VERDICT_CACHE_SIZE = 1024  # verdicts kept (a digest and a message each)


def fingerprint(so: StructuredOutputsParams) -> str:
    """A digest of the constraint as given (its kind, options and raw text), before any conversion: the verdict
    cache's key. Computed once per params object (a request's prompts share theirs), so the per-prompt lookup
    costs no hashing of a 256 KB grammar, nor serializing a schema."""
    memo = _memo.get(so)
    if memo is not None:
        return memo[0]
    kind, value = so.kind, so.value
    if not isinstance(value, str):
        try:
            value = json.dumps(value, separators=(",", ":"))
        except RecursionError:  # a dict schema nested deeper than json.dumps goes
            raise ValueError(f"the structured output constraint nests more than {limits.MAX_JSON_NESTING} deep; "
                             f"the limit is {limits.MAX_JSON_NESTING}.") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"the structured output {kind} is not JSON: {e}") from None
    h = hashlib.sha256(f"{kind}\0{so.disable_any_whitespace}\0".encode())
    h.update(value.encode("utf-8", "surrogatepass"))
    key = h.hexdigest()
    _memo.put(so, key, None)
    return key


class _ObjectMemo:
    """params object -> (fingerprint, verdict or None), for as long as the object lives (weak: nothing is kept
    after the request). Objects are matched by identity: StructuredOutputsParams is an unhashable dataclass."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, tuple[weakref.ref, str, str | None]] = {}

    def get(self, so) -> tuple[str, str | None] | None:
        with self._lock:
            item = self._items.get(id(so))
        if item is None or item[0]() is not so:
            return None
        return item[1], item[2]

    def put(self, so, key: str, verdict: str | None) -> None:
        oid = id(so)

        def forget(ref: weakref.ref) -> None:
            with self._lock:
                if self._items.get(oid, (None,))[0] is ref:
                    del self._items[oid]

        with self._lock:
            old = self._items.get(oid)
            ref = old[0] if old is not None and old[0]() is so else weakref.ref(so, forget)
            self._items[oid] = (ref, key, verdict)


class _Verdicts:
    """Verdicts by fingerprint ("" valid, else the 400's message), least recently used dropped first. Shared by
    the server's grammar-check threads and the event loop (the processor's per-prompt lookup), so every access
    holds one lock; a constraint is checked by one thread while the others asking for it wait for its verdict."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._done: OrderedDict[str, str] = OrderedDict()
        self._running: dict[str, threading.Event] = {}

    def get(self, key: str) -> str | None:
        with self._lock:
            verdict = self._done.get(key)
            if verdict is not None:
                self._done.move_to_end(key)
            return verdict

    def get_or_compute(self, key: str, compute: Callable[[], str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                verdict = self._done.get(key)
                if verdict is not None:
                    self._done.move_to_end(key)
                    return verdict
                running = self._running.get(key)
                if running is None:
                    running = self._running[key] = threading.Event()
                    break
            # Another thread checks this one: its verdict, or (it failed without one) the turn to try.
            if not running.wait(max(0.0, deadline - time.monotonic())):
                raise isolation.CheckerUnavailable(f"the same grammar is still being checked after {timeout:g} s.")
        try:
            verdict = compute()
            with self._lock:
                self._done[key] = verdict
                while len(self._done) > self.size:
                    self._done.popitem(last=False)
        finally:  # with a verdict or not (CheckerUnavailable: none to keep), the waiters go on
            with self._lock:
                del self._running[key]
            running.set()
        return verdict

    def clear(self) -> None:
        with self._lock:
            self._done.clear()


_memo = _ObjectMemo()
_verdicts = _Verdicts(VERDICT_CACHE_SIZE)


def _verdict(so: StructuredOutputsParams) -> str:
    """The conversion (limits included), then llguidance's check in a worker: "" or the 400's message."""
    try:
        grammar = to_grammar(so)
    except ValueError as e:
        return str(e) or "the structured output constraint is invalid."
    error = isolation.check_isolated(grammar, VALIDATE_TIMEOUT_S)  # CheckerUnavailable: no verdict (503)
    return f"invalid {so.kind.replace('_', ' ')} constraint: {error.strip()}" if error else ""


def validate(so: StructuredOutputsParams) -> None:
    """Check the constraint compiles (without the tokenizer): its limits and conversion here, llguidance's check
    in a worker process (isolation.check_isolated). ValueError (a 400) when it does not; CheckerUnavailable (a 503)
    when no worker can check it now.

    Once per distinct constraint: the verdict is cached by `fingerprint` (a digest of the raw text, taken
    before any conversion) and kept on the params object, so the processor's per-prompt call on the event loop
    is a lookup. The server calls this off the event loop first (serve/structured.py)."""
    memo = _memo.get(so)
    if memo is not None and memo[1] is not None:
        verdict = memo[1]
    else:
        key = fingerprint(so)
        verdict = _verdicts.get_or_compute(key, lambda: _verdict(so), VALIDATE_TIMEOUT_S * 3)
        _memo.put(so, key, verdict)
    if verdict:
        raise ValueError(verdict)
