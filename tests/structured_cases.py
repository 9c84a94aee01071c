"""Deterministic generators of structured-output test cases (JSON schemas, regexes, choices, a Lark grammar).

Meant for constrained-generation tests (llguidance): a model samples at temperature 1 under each constraint
and every output must validate. So every case here is *bounded*: the set of texts a constraint admits is
finite and short, and nothing lets the model ramble (every object has ``additionalProperties: false``, every
free string a ``maxLength``, every number a ``multipleOf``, every array a ``maxItems``, every regex has
bounded quantifiers only).

JSON grammars: compile with ``LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT_JSON_OPTIONS)``.
llguidance's default (``whitespace_flexible``) admits unbounded runs of whitespace between tokens, which
``max_json_chars`` does not (cannot) bound.

Nothing here imports llguidance, so the module is importable wherever the tests are.
"""
from __future__ import annotations

import json
import random
from decimal import Decimal
from fractions import Fraction
from typing import Any

try:  # Python >= 3.11
    import re._constants as _sre_c
    import re._parser as _sre_p
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_p  # type: ignore[no-redef]

__all__ = [
    "ARITH_LARK",
    "ARITH_MAX_CHARS",
    "COMPACT_JSON_OPTIONS",
    "MAX_JSON_CHARS",
    "MAX_REGEX_CHARS",
    "choice_lists",
    "json_example",
    "json_schemas",
    "max_json_chars",
    "parse_arith",
    "arith_example",
    "regex_example",
    "regex_max_len",
    "regexes",
    "validate_json",
]

# llguidance JSON compile options under which max_json_chars is an upper bound on the output.
COMPACT_JSON_OPTIONS = {"whitespace_flexible": False}
# Every schema from json_schemas() has max_json_chars(schema) <= MAX_JSON_CHARS.
MAX_JSON_CHARS = 400
# Every regex from regexes() matches only strings of at most this many characters.
MAX_REGEX_CHARS = 40
# Worst case width of one string character in JSON: a control character is written "\u00XX" (6 chars).
# A raw character is at most 4 UTF-8 bytes, so 6 also bounds the bytes per character.
_ESCAPE_WIDTH = 6

# --------------------------------------------------------------------------------------------------------
# JSON schemas
# --------------------------------------------------------------------------------------------------------

_KEYS = [
    "name", "age", "id", "email", "tags", "active", "score", "price", "city", "country", "status", "count",
    "items", "color", "size", "title", "year", "code", "level", "notes", "owner", "address", "meta", "dims",
    "unit", "kind", "rank", "label", "value", "weight", "height", "flag", "zip", "phone", "role", "mode",
    "first_name", "last_name", "isValid", "x", "y", "z", "user-id", "max_len", "ok", "data",
]
_STRING_ENUMS = [
    ["red", "green", "blue"],
    ["small", "medium", "large", "x-large"],
    ["yes", "no"],
    ["north", "south", "east", "west"],
    ["draft", "review", "published", "archived"],
    ["cat", "dog", "bird", "fish", "hamster"],
    ["low", "high"],
    ["café", "thé", "naïve"],
    ["C", "C++", "C#", "Go"],
    ["red", "reddish", "red wine"],
    ["N/A", "TBD"],
    ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"],
]
_NUMBER_ENUMS = [
    [1, 2, 3],
    [0, 10, 100, 1000],
    [-1, 0, 1],
    [0.5, 1.5, 2.5],
    [3.14, 2.72, 1.41],
    [7, -3.25, 42],
    [12, 24, 36, 48],
]
_MIXED_ENUMS = [
    ["auto", 0, 1],
    ["none", None],
    [True, "maybe", False],
]
# Anchored, ASCII-only, nothing that JSON must escape, so each character serializes to one byte.
_PATTERNS = [
    "^[a-z]{2,6}$",
    "^[0-9]{3}-[0-9]{4}$",
    "^[A-Z][a-z]{1,7}$",
    "^(yes|no|maybe)$",
    "^[a-f0-9]{6}$",
    "^#[0-9a-fA-F]{6}$",
    "^[A-Z]{2}[0-9]{2,4}$",
    "^v[0-9]\\.[0-9]{1,2}$",
    "^[a-z]{3,8}@[a-z]{3,6}\\.(com|org)$",
    "^[0-9]{4}-(0[1-9]|1[0-2])-[0-9]{2}$",
    "^([01][0-9]|2[0-3]):[0-5][0-9]$",
    "^[a-z_][a-z0-9_]{0,9}$",
    "^[0-9]{5}(-[0-9]{4})?$",
    "^(\\+1 )?[0-9]{3} [0-9]{3} [0-9]{4}$",
]
_CONSTS = ["fixed", "v1", 3, 0, True, False, None, "hello world", 2.5]
_MULTIPLES = [0.5, 0.25]  # exact in binary: jsonschema's float multipleOf check is exact for these
_MAX_LENGTHS = [1, 3, 4, 5, 6, 8, 8, 10, 10, 12, 16, 20]


def _int_bounds(rng: random.Random) -> tuple[int, int]:
    lo = rng.choice([0, 0, 1, -10, -100, -1000, 18, 1900])
    span = rng.choice([1, 5, 10, 99, 100, 1000, 2000])
    return lo, lo + span


def _integer_schema(rng: random.Random) -> dict:
    lo, hi = _int_bounds(rng)
    s: dict = {"type": "integer"}
    r = rng.random()
    if r < 0.25:
        s["exclusiveMinimum"] = lo - 1
        s["maximum"] = hi
    elif r < 0.35:
        s["minimum"] = lo
        s["exclusiveMaximum"] = hi + 1
    else:
        s["minimum"] = lo
        s["maximum"] = hi
    if rng.random() < 0.1 and hi - lo >= 10:
        s["multipleOf"] = rng.choice([2, 5, 10])
    return s


def _number_schema(rng: random.Random) -> dict:
    lo, hi = rng.choice([(0, 1), (0, 100), (-50, 50), (-1, 1), (0, 10), (-273, 1000), (1, 5)])
    s: dict = {"type": "number"}
    if rng.random() < 0.3:
        s["exclusiveMinimum"] = lo
    else:
        s["minimum"] = lo
    s["maximum"] = hi
    s["multipleOf"] = rng.choice(_MULTIPLES)
    return s


def _free_string_schema(rng: random.Random) -> dict:
    s: dict = {"type": "string", "maxLength": rng.choice(_MAX_LENGTHS)}
    if rng.random() < 0.3:
        s["minLength"] = rng.randint(1, s["maxLength"])
    return s


def _simple_schema(rng: random.Random, kind: str | None = None) -> dict:
    """A schema for one scalar value."""
    if kind is None:
        kind = rng.choices(
            ["string", "pattern", "str_enum", "num_enum", "mixed_enum", "integer", "number", "boolean", "null",
             "const", "anyOf"],
            weights=[18, 10, 10, 5, 2, 16, 10, 8, 3, 4, 6],
        )[0]
    if kind == "string":
        return _free_string_schema(rng)
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "str_enum":
        s = {"type": "string", "enum": list(rng.choice(_STRING_ENUMS))}
        if rng.random() < 0.5:
            del s["type"]
        return s
    if kind == "num_enum":
        return {"enum": list(rng.choice(_NUMBER_ENUMS))}
    if kind == "mixed_enum":
        return {"enum": list(rng.choice(_MIXED_ENUMS))}
    if kind == "integer":
        return _integer_schema(rng)
    if kind == "number":
        return _number_schema(rng)
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "const":
        return {"const": rng.choice(_CONSTS)}
    if kind == "anyOf":
        a, b = rng.sample(["string", "pattern", "integer", "number", "boolean", "null", "str_enum"], 2)
        return {"anyOf": [_simple_schema(rng, a), _simple_schema(rng, b)]}
    raise AssertionError(kind)


def _object_schema(rng: random.Random, depth: int) -> dict:
    n = rng.choice([1, 2, 2, 3, 3, 4, 5, 6] if depth == 1 else [1, 2, 2, 3, 3, 4])
    keys = rng.sample(_KEYS, n)
    props = {k: _value_schema(rng, depth) for k in keys}
    s: dict = {"type": "object", "properties": props}
    r = rng.random()
    if r < 0.5:
        s["required"] = list(keys)
    elif r < 0.85:
        s["required"] = sorted(rng.sample(keys, rng.randint(1, n)), key=keys.index)
    # else: nothing required
    s["additionalProperties"] = False
    return s


def _array_schema(rng: random.Random, depth: int) -> dict:
    if depth < 3 and rng.random() < 0.3:
        items = _object_schema(rng, depth + 1)
    else:
        items = _simple_schema(rng)
    hi = rng.randint(1, 4)
    s: dict = {"type": "array", "items": items}
    if rng.random() < 0.6:
        s["minItems"] = rng.randint(0, hi)
    s["maxItems"] = hi
    return s


def _value_schema(rng: random.Random, depth: int) -> dict:
    """Schema of a property of an object at container depth `depth` (the root is depth 1)."""
    if depth < 3:
        r = rng.random()
        if r < 0.14:
            return _object_schema(rng, depth + 1)
        if r < 0.30:
            return _array_schema(rng, depth + 1)
    return _simple_schema(rng)


def json_schemas(n: int = 200, seed: int = 0) -> list[dict]:
    """`n` bounded JSON schemas (Draft 2020-12), each with max_json_chars(schema) <= MAX_JSON_CHARS.

    The root is an object (about 9 in 10) or an array; objects nest to container depth 3 at most.
    """
    rng = random.Random(seed)
    out: list[dict] = []
    seen: set[str] = set()
    while len(out) < n:
        if rng.random() < 0.9:
            s = _object_schema(rng, 1)
        else:
            s = _array_schema(rng, 1)
        key = json.dumps(s, sort_keys=True)
        if max_json_chars(s) <= MAX_JSON_CHARS and key not in seen:
            seen.add(key)
            s = {"$schema": "https://json-schema.org/draft/2020-12/schema", **s} if rng.random() < 0.2 else s
            out.append(s)
    return out


def _literal_len(v: Any) -> int:
    return len(json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def _frac_digits(m: float | int) -> int:
    return max(0, -Decimal(str(m)).as_tuple().exponent)


def max_json_chars(schema: dict) -> int:
    """Upper bound on the length of any compact-JSON text the schema admits.

    Compact: no whitespace, "," and ":" separators (COMPACT_JSON_OPTIONS in llguidance). The bound is on
    characters and on UTF-8 bytes alike (free string characters count 6, the width of a "\\u00XX" escape),
    so it also bounds the number of tokens of any byte-level tokenizer.
    Raises ValueError for a schema outside the bounded subset these generators use.
    """
    if "const" in schema:
        return _literal_len(schema["const"])
    if "enum" in schema:
        return max(_literal_len(v) for v in schema["enum"])
    if "anyOf" in schema:
        return max(max_json_chars(s) for s in schema["anyOf"])
    t = schema.get("type")
    if t == "null":
        return 4
    if t == "boolean":
        return 5
    if t in ("integer", "number"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        if lo is None or hi is None:
            raise ValueError(f"unbounded {t}: {schema}")
        whole = max(len(str(abs(int(lo)))), len(str(abs(int(hi))))) + (1 if lo < 0 else 0)
        if t == "integer":
            return whole
        if "multipleOf" not in schema:
            raise ValueError(f"number without multipleOf has unbounded decimals: {schema}")
        frac = _frac_digits(schema["multipleOf"])
        return whole + (1 + frac if frac else 0)
    if t == "string":
        if "pattern" in schema:
            return 2 + _pattern_max_len(schema["pattern"])
        if "maxLength" not in schema:
            raise ValueError(f"unbounded string: {schema}")
        return 2 + _ESCAPE_WIDTH * schema["maxLength"]
    if t == "array":
        if "maxItems" not in schema:
            raise ValueError(f"unbounded array: {schema}")
        k = schema["maxItems"]
        return 2 + k * max_json_chars(schema["items"]) + max(0, k - 1) if k else 2
    if t == "object":
        if schema.get("additionalProperties") is not False:
            raise ValueError(f"object admits additional properties: {schema}")
        props = schema.get("properties", {})
        body = sum(_literal_len(k) + 1 + max_json_chars(v) for k, v in props.items())
        return 2 + body + max(0, len(props) - 1)
    raise ValueError(f"unsupported schema: {schema}")


def _pattern_max_len(pattern: str) -> int:
    """Longest match of an anchored, ASCII, JSON-escape-free pattern (in characters = bytes = JSON chars)."""
    if not (pattern.startswith("^") and pattern.endswith("$")):
        raise ValueError(f"pattern must be anchored (JSON Schema patterns search): {pattern!r}")
    tree = _sre_p.parse(pattern)
    for code in _literal_codes(tree):
        if not (0x20 <= code < 0x7F) or chr(code) in '"\\':
            raise ValueError(f"pattern admits a character JSON escapes or a non-ASCII one: {pattern!r}")
    return regex_max_len(pattern)


# --------------------------------------------------------------------------------------------------------
# Examples from schemas (text as llguidance emits it with COMPACT_JSON_OPTIONS)
# --------------------------------------------------------------------------------------------------------

_STRING_CHARS = "abcdefghijklmnopqrstuvwxyzABC XYZ0123456789-_.,!?/" + "éü日本😀" + '"\\\n\t\x01'


def _fmt_number(v: Fraction, frac: int) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    return f"{float(v):.{frac}f}"


def json_example(schema: dict, rng: random.Random) -> str:
    """A random compact JSON text valid for `schema` (one from json_schemas()).

    Numbers are written as llguidance 1.9.1 admits them: a non-integral multiple of 0.25 with exactly two
    decimals ("2.75", not "2.5" or "2.500"), and never ending in "0" after the point, because with
    multipleOf 0.25 it rejects some valid values such as "0.50" in (0, 1] and "-0.50" in [-2, 5] (stricter
    than the schema: harmless for generation, but such examples would not round-trip).
    """
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    if "enum" in schema:
        return json.dumps(rng.choice(schema["enum"]), ensure_ascii=False)
    if "anyOf" in schema:
        return json_example(rng.choice(schema["anyOf"]), rng)
    t = schema["type"]
    if t == "null":
        return "null"
    if t == "boolean":
        return rng.choice(["true", "false"])
    if t in ("integer", "number"):
        m = Fraction(str(schema.get("multipleOf", 1)))
        lo = Fraction(str(schema.get("minimum", schema.get("exclusiveMinimum"))))
        hi = Fraction(str(schema.get("maximum", schema.get("exclusiveMaximum"))))
        kmin, kmax = -(-lo // m), hi // m
        if "exclusiveMinimum" in schema and kmin * m == lo:
            kmin += 1
        if "exclusiveMaximum" in schema and kmax * m == hi:
            kmax -= 1
        while True:
            text = _fmt_number(rng.randint(kmin, kmax) * m, _frac_digits(schema.get("multipleOf", 1)))
            if not ("." in text and text.endswith("0")):
                return text
    if t == "string":
        if "pattern" in schema:
            return json.dumps(regex_example(schema["pattern"], rng))
        k = rng.randint(schema.get("minLength", 0), schema["maxLength"])
        return json.dumps("".join(rng.choice(_STRING_CHARS) for _ in range(k)), ensure_ascii=False)
    if t == "array":
        k = rng.randint(schema.get("minItems", 0), schema["maxItems"])
        return "[" + ",".join(json_example(schema["items"], rng) for _ in range(k)) + "]"
    if t == "object":
        req = set(schema.get("required", []))
        parts = [
            json.dumps(k) + ":" + json_example(v, rng)
            for k, v in schema["properties"].items()
            if k in req or rng.random() < 0.5
        ]
        return "{" + ",".join(parts) + "}"
    raise ValueError(f"unsupported schema: {schema}")


def validate_json(text: str, schema: dict) -> Any:
    """Parse `text` as strict JSON and validate it against `schema` (Draft 2020-12); return the value.

    Raises AssertionError naming what is wrong (not JSON / which keyword fails at which path).
    NaN/Infinity and duplicate object keys are rejected: they are not JSON a constraint should admit.
    """
    import jsonschema

    def no_constants(name: str):
        raise ValueError(f"{name} is not JSON")

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(keys) != len(set(keys)):
            raise ValueError(f"duplicate keys in object: {keys}")
        return dict(pairs)

    try:
        value = json.loads(text, parse_constant=no_constants, object_pairs_hook=no_duplicates)
    except ValueError as e:
        raise AssertionError(f"not valid JSON ({e}): {text!r}") from None
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.path))
    if errors:
        lines = [f"  at {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors[:5]]
        raise AssertionError(
            f"JSON does not match the schema ({len(errors)} errors):\n" + "\n".join(lines)
            + f"\ntext: {text!r}\nschema: {json.dumps(schema)}"
        )
    return value


# --------------------------------------------------------------------------------------------------------
# Regexes (same meaning under Python re.fullmatch and Rust's regex crate)
# --------------------------------------------------------------------------------------------------------


def _rep(rng: random.Random, lo_choices, span_choices) -> tuple[int, int]:
    lo = rng.choice(lo_choices)
    return lo, lo + rng.choice(span_choices)


def _rx_date(rng):
    sep = rng.choice(["-", "/", "\\."])
    day = rng.choice(["[0-9]{2}", "(0[1-9]|[12][0-9]|3[01])"])
    year = rng.choice(["[0-9]{4}", "(19|20)[0-9]{2}"])
    return f"{year}{sep}(0[1-9]|1[0-2]){sep}{day}"


def _rx_time(rng):
    hh = rng.choice(["([01][0-9]|2[0-3])", "(1[0-2]|0?[1-9])"])
    tail = rng.choice(["", "(:[0-5][0-9])?", " ?(AM|PM|am|pm)"])
    return f"{hh}:[0-5][0-9]{tail}"


def _rx_email(rng):
    a, b = _rep(rng, [1, 2, 3], [3, 5, 7])
    c, d = _rep(rng, [2, 3], [2, 3, 4])
    tld = rng.choice(["(com|org)", "(com|org|net|io)", "[a-z]{2,3}"])
    dot = rng.choice(["", "(\\.[a-z]{1,4})?", "([._][a-z0-9]{1,3})?"])
    return f"[a-z]{{{a},{b}}}{dot}@[a-z]{{{c},{d}}}\\.{tld}"


def _rx_phone(rng):
    return rng.choice([
        "\\([0-9]{3}\\) [0-9]{3}-[0-9]{4}",
        "[0-9]{3}-[0-9]{3}-[0-9]{4}",
        "\\+[0-9]{1,3} [0-9]{3} [0-9]{3} [0-9]{4}",
        "[0-9]{3}-[0-9]{4}",
        "(\\+44 ?|0)[0-9]{4} ?[0-9]{6}",
        "[2-9][0-9]{2}\\.[0-9]{3}\\.[0-9]{4}",
    ])


def _rx_hex(rng):
    k = rng.choice([2, 4, 6, 8])
    return rng.choice([
        "#[0-9a-f]{6}",
        "#([0-9a-fA-F]{3}|[0-9a-fA-F]{6})",
        f"0x[0-9A-F]{{1,{k}}}",
        f"[0-9a-f]{{{k}}}",
        "rgb\\(([0-9]{1,3}, ?){2}[0-9]{1,3}\\)",
    ])


def _rx_ipv4(rng):
    octet = rng.choice(["[0-9]{1,3}", "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"])
    port = rng.choice(["", "(:[0-9]{2,5})?"])
    return f"({octet}\\.){{3}}{octet}{port}"


def _rx_semver(rng):
    pre = rng.choice(["", "(-(alpha|beta|rc)[0-9]?)?", "(-rc\\.[0-9])?"])
    return f"{rng.choice(['v', 'v?', ''])}[0-9]{{1,2}}\\.[0-9]{{1,2}}\\.[0-9]{{1,3}}{pre}"


def _rx_ident(rng):
    n = rng.choice([3, 7, 11, 15, 19])
    first = rng.choice(["[a-z_]", "[A-Za-z_]", "[a-z]"])
    return f"{first}[a-z0-9_]{{0,{n}}}"


def _rx_words(rng):
    a = rng.sample(["red", "green", "blue", "yellow", "purple", "orange", "black", "white"], rng.randint(2, 4))
    b = rng.sample(["small", "large", "tiny", "huge", "medium"], rng.randint(2, 3))
    return f"({'|'.join(a)})( ({'|'.join(b)}))?" if rng.random() < 0.6 else f"({'|'.join(a)})-({'|'.join(b)})"


def _rx_zip(rng):
    return rng.choice(["[0-9]{5}(-[0-9]{4})?", "[A-Z][0-9][A-Z] ?[0-9][A-Z][0-9]", "[0-9]{2}-[0-9]{3}"])


def _rx_uuid(rng):
    return rng.choice([
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
        "[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}",
    ])


def _rx_card(rng):
    sep = rng.choice([" ", "-", "[ -]?"])
    return f"[0-9]{{4}}({sep}[0-9]{{4}}){{3}}"


def _rx_sentence(rng):
    w = rng.choice([4, 6, 8])
    k = rng.choice([1, 2, 3])
    return f"[A-Z][a-z]{{1,{w}}}( [a-z]{{1,{w}}}){{0,{k}}}[.!?]"


def _rx_filename(rng):
    ext = rng.choice(["(txt|csv|json|py)", "(png|jpe?g|gif)", "[a-z]{2,4}"])
    return f"[a-z]{{1,8}}(_[0-9]{{1,3}})?\\.{ext}"


def _rx_money(rng):
    return rng.choice([
        "\\$[1-9][0-9]{0,3}\\.[0-9]{2}",
        "[0-9]{1,3}(,[0-9]{3})? (USD|EUR|GBP)",
        "-?[0-9]{1,5}(\\.[0-9]{1,2})?",
        "[+-]?[0-9]{1,4}",
        "(100|[1-9]?[0-9])%",
    ])


def _count(lo: int, hi: int) -> str:
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def _rx_code(rng):
    return f"[A-Z]{_count(*_rep(rng, [2, 3], [0, 1]))}-[0-9]{_count(*_rep(rng, [2, 3, 4], [0, 2]))}"


def _rx_misc(rng):
    return rng.choice([
        "(yes|no|true|false|maybe)",
        "[a-z]{1,6}=([0-9]{1,4}|[a-z]{1,6})",
        "https?://[a-z]{3,10}\\.(com|org)(/[a-z]{1,6})?",
        "(café|naïve|résumé|日本)( [0-9]{1,2})?",
        "[a-z0-9._-]{3,12}",
        "(Mon|Tue|Wed|Thu|Fri|Sat|Sun), [0-9]{1,2} (Jan|Feb|Mar|Apr)",
        "[ACGT]{4,20}",
        "(ab|cd){1,4}(ef)?",
        "(a|b)?(c|d)?e{2,3}",
        "[0-1]{8}",
        "\\[[0-9]{1,2}(, [0-9]{1,2}){0,3}\\]",
        "[A-Z]{1,3}[0-9]{1,3}(:[A-Z]{1,3}[0-9]{1,3})?",
    ])


_REGEX_MAKERS = [
    _rx_date, _rx_time, _rx_email, _rx_phone, _rx_hex, _rx_ipv4, _rx_semver, _rx_ident, _rx_words, _rx_zip,
    _rx_uuid, _rx_card, _rx_sentence, _rx_filename, _rx_money, _rx_code, _rx_misc,
]


def regexes(n: int = 50, seed: int = 0) -> list[str]:
    """`n` distinct regexes for fullmatch: literals, classes, bounded repeats, ?, alternation, groups.

    No anchors, lookaround, backrefs, \\d/\\w/\\s, '.', '*' or '+'; each matches only strings of at most
    MAX_REGEX_CHARS characters, and means the same in Python (re.fullmatch) and in Rust's regex crate.
    """
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n:
            raise RuntimeError(f"only {len(out)} distinct regexes")
        # Round-robin over the makers first, so small n still covers every family.
        maker = _REGEX_MAKERS[len(out) % len(_REGEX_MAKERS)] if len(out) < len(_REGEX_MAKERS) else rng.choice(
            _REGEX_MAKERS)
        rx = maker(rng)
        if rx in seen or regex_max_len(rx) > MAX_REGEX_CHARS:
            continue
        seen.add(rx)
        out.append(rx)
    return out


def _literal_codes(tree) -> list[int]:
    """Every code point a parsed regex can match literally (ranges: both ends; enough for ASCII checks)."""
    codes: list[int] = []
    for op, av in tree:
        if op is _sre_c.LITERAL:
            codes.append(av)
        elif op is _sre_c.IN:
            for iop, iav in av:
                if iop is _sre_c.LITERAL:
                    codes.append(iav)
                elif iop is _sre_c.RANGE:
                    codes.extend(iav)
        elif op in (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT):
            codes.extend(_literal_codes(av[2]))
        elif op is _sre_c.SUBPATTERN:
            codes.extend(_literal_codes(av[3]))
        elif op is _sre_c.BRANCH:
            for sub in av[1]:
                codes.extend(_literal_codes(sub))
    return codes


def regex_max_len(rx: str) -> int:
    """Length in characters of the longest string `rx` matches (a huge number when unbounded)."""
    return _sre_p.parse(rx).getwidth()[1]


def regex_example(rx: str, rng: random.Random) -> str:
    """A random string that `rx` fully matches (supports the constructs regexes() and _PATTERNS use)."""
    return "".join(_gen(_sre_p.parse(rx), rng))


def _gen(tree, rng: random.Random) -> list[str]:
    out: list[str] = []
    for op, av in tree:
        if op is _sre_c.LITERAL:
            out.append(chr(av))
        elif op is _sre_c.IN:
            choices: list[int] = []
            for iop, iav in av:
                if iop is _sre_c.LITERAL:
                    choices.append(iav)
                elif iop is _sre_c.RANGE:
                    choices.extend(range(iav[0], iav[1] + 1))
                else:
                    raise ValueError(f"unsupported class item {iop} in regex")
            out.append(chr(rng.choice(choices)))
        elif op in (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT):
            lo, hi, sub = av
            if hi == _sre_c.MAXREPEAT:
                raise ValueError("unbounded repeat")
            for _ in range(rng.randint(lo, hi)):
                out.extend(_gen(sub, rng))
        elif op is _sre_c.SUBPATTERN:
            out.extend(_gen(av[3], rng))
        elif op is _sre_c.BRANCH:
            out.extend(_gen(rng.choice(av[1]), rng))
        elif op is _sre_c.AT:
            pass  # ^ / $ at the ends of a JSON Schema pattern
        else:
            raise ValueError(f"unsupported regex construct {op}")
    return out


# --------------------------------------------------------------------------------------------------------
# Choice lists
# --------------------------------------------------------------------------------------------------------

_CHOICE_POOLS = [
    ["red", "reddish", "red wine", "redo", "green", "greenish", "blue"],
    ["yes", "no", "maybe", "yes!", "no.", "N/A"],
    ["positive", "negative", "neutral", "mixed"],
    ["café", "naïve", "résumé", "Zürich", "日本語", "😀 happy", "São Paulo"],
    ["The answer is A", "The answer is B", "The answer is C", "The answer is D"],
    ["C", "C++", "C#", "Objective-C", "Go", "Rust", "Python 3"],
    ["cat", "caterpillar", "category", "dog", "dogma"],
    ["1", "10", "100", "1000", "2", "20"],
    ["true", "false", "null"],
    ["New York", "New Jersey", "New Mexico", "Newark", "York"],
    ["it's fine", "it isn't", "don't know", "I'd say so"],
    ['"quoted"', "(parenthesized)", "[bracketed]", "{braced}", "a/b", "x\\y"],
    ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    ["a", "ab", "abc", "abcd"],
    ["spam", "ham", "eggs", "spam and eggs", "spam, spam"],
]


def choice_lists(n: int = 20, seed: int = 0) -> list[list[str]]:
    """`n` lists of 2..8 distinct, non-empty strings: words, phrases, shared prefixes, punctuation, unicode."""
    rng = random.Random(seed)
    out: list[list[str]] = []
    for i in range(n):
        pool = _CHOICE_POOLS[i % len(_CHOICE_POOLS)] if i < len(_CHOICE_POOLS) else rng.choice(_CHOICE_POOLS)
        if rng.random() < 0.25:  # mix in a few from another pool
            pool = list(dict.fromkeys(pool + rng.sample(rng.choice(_CHOICE_POOLS), 2)))
        k = rng.randint(2, min(8, len(pool)))
        out.append(rng.sample(pool, k))
    return out


# --------------------------------------------------------------------------------------------------------
# Arithmetic: a finite Lark grammar and its reference parser
# --------------------------------------------------------------------------------------------------------

# Operands per expression at each parenthesis depth (0 = top level). Parentheses nest at most 2 deep, so the
# language is finite: its longest text has ARITH_MAX_CHARS characters. No whitespace, no unary minus.
_ARITH_OPERANDS = (4, 3, 3)
_ARITH_LEVELS = len(_ARITH_OPERANDS)

ARITH_LARK = r"""
// Arithmetic over 0..99 with + - * / and parentheses nested at most two deep; finite by construction.
start: expr0
expr0: operand0 (OP operand0){0,3}
operand0: NUMBER | "(" expr1 ")"
expr1: operand1 (OP operand1){0,2}
operand1: NUMBER | "(" expr2 ")"
expr2: NUMBER (OP NUMBER){0,2}
OP: "+" | "-" | "*" | "/"
NUMBER: /0|[1-9][0-9]?/
"""


def _arith_max_chars() -> int:
    inner = 0
    for level in reversed(range(_ARITH_LEVELS)):
        operand = 2 if level == _ARITH_LEVELS - 1 else max(2, inner + 2)
        k = _ARITH_OPERANDS[level]
        inner = k * operand + (k - 1)
    return inner


ARITH_MAX_CHARS = _arith_max_chars()  # 139


def parse_arith(text: str) -> Fraction | None:
    """Evaluate `text` if it is in ARITH_LARK's language: the exact value (* and / bind tighter than + and -,
    all left-associative), or None when it divides by zero. Raises ValueError for any text outside the
    language (the grammar's rules, checked with the same operand and depth limits).
    """
    pos = 0

    def fail(msg: str):
        raise ValueError(f"{msg} at offset {pos} in {text!r}")

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def number() -> Fraction:
        nonlocal pos
        c = peek()
        if c == "0":
            pos += 1
            return Fraction(0)
        if c and c in "123456789":
            start = pos
            pos += 1
            if peek() and peek() in "0123456789":
                pos += 1
            return Fraction(int(text[start:pos]))
        fail("expected a number")

    def operand(level: int) -> Fraction | None:
        nonlocal pos
        if peek() == "(":
            if level + 1 >= _ARITH_LEVELS:
                fail("parentheses nested too deep")
            pos += 1
            v = expr(level + 1)
            if peek() != ")":
                fail("expected ')'")
            pos += 1
            return v
        return number()

    def expr(level: int) -> Fraction | None:
        nonlocal pos
        vals = [operand(level)]
        ops: list[str] = []
        while peek() and peek() in "+-*/":
            if len(vals) == _ARITH_OPERANDS[level]:
                fail("too many operands")
            ops.append(peek())
            pos += 1
            vals.append(operand(level))
        return _evaluate(vals, ops)

    value = expr(0)
    if pos != len(text):
        fail("unexpected text")
    return value


def _evaluate(vals: list[Fraction | None], ops: list[str]) -> Fraction | None:
    # Products first (left to right), then sums; None (division by zero) is absorbing.
    terms: list[Fraction | None] = [vals[0]]
    signs: list[str] = []
    for op, v in zip(ops, vals[1:]):
        if op in "*/":
            a = terms[-1]
            if a is None or v is None or (op == "/" and v == 0):
                terms[-1] = None
            else:
                terms[-1] = a * v if op == "*" else a / v
        else:
            signs.append(op)
            terms.append(v)
    if any(t is None for t in terms):
        return None
    total = terms[0]
    for s, t in zip(signs, terms[1:]):
        total = total + t if s == "+" else total - t
    return total


def arith_example(rng: random.Random, level: int = 0) -> str:
    """A random text in ARITH_LARK's language."""
    k = rng.randint(1, _ARITH_OPERANDS[level])
    parts = []
    for i in range(k):
        if i:
            parts.append(rng.choice("+-*/"))
        if level + 1 < _ARITH_LEVELS and rng.random() < 0.3:
            parts.append("(" + arith_example(rng, level + 1) + ")")
        else:
            parts.append(str(rng.choice([0, rng.randint(1, 9), rng.randint(10, 99)])))
    return "".join(parts)
