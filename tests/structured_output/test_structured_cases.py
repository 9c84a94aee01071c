"""The structured-output case generators (tests/structured_cases.py), checked without a model.

The llguidance part runs each constraint against the tiny byte-level test tokenizer: conforming examples
must be accepted (and Python must agree on near-miss mutations), and random walks through the token masks
(a uniform "model") must end within the length bound in text that Python validates.
"""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

import structured_cases as sc
from structured_cases import _sre_p

SCHEMAS = sc.json_schemas()
REGEXES = sc.regexes()
CHOICES = sc.choice_lists()


# --------------------------------------------------------------------------------------------------------
# Generators alone
# --------------------------------------------------------------------------------------------------------


def test_counts_and_determinism():
    assert len(SCHEMAS) == 200 and len(REGEXES) == 50 and len(CHOICES) == 20
    assert sc.json_schemas() == SCHEMAS and sc.regexes() == REGEXES and sc.choice_lists() == CHOICES
    assert sc.json_schemas(200, seed=1) != SCHEMAS
    assert sc.regexes(50, seed=1) != REGEXES
    assert sc.choice_lists(20, seed=1) != CHOICES
    assert len(sc.json_schemas(7, seed=3)) == 7 and len(sc.regexes(5, seed=3)) == 5
    assert len(set(REGEXES)) == len(REGEXES)
    assert len({json.dumps(s, sort_keys=True) for s in SCHEMAS}) == len(SCHEMAS)


def _subschemas(s: dict, depth: int = 1):
    """(schema, container depth) for every schema node; depth counts objects and arrays from the root."""
    yield s, depth
    inner = depth + 1 if s.get("type") in ("object", "array") else depth
    for v in s.get("properties", {}).values():
        yield from _subschemas(v, inner)
    if "items" in s:
        yield from _subschemas(s["items"], inner)
    for v in s.get("anyOf", []):
        yield from _subschemas(v, depth)


def _container_depth(s: dict) -> int:
    return max(d - (0 if n.get("type") in ("object", "array") else 1) for n, d in _subschemas(s))


def test_schemas_are_valid_draft_2020_12():
    for s in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(s)


def test_schemas_are_bounded():
    sizes = []
    for s in SCHEMAS:
        assert _container_depth(s) <= 3, s
        for node, _ in _subschemas(s):
            t = node.get("type")
            if t == "object":
                assert node["additionalProperties"] is False, node
                assert 1 <= len(node["properties"]) <= 6, node
                assert set(node.get("required", [])) <= set(node["properties"]), node
            elif t == "array":
                assert node.get("minItems", 0) <= node["maxItems"] <= 4, node
            elif t == "string" and "enum" not in node and "pattern" not in node:
                assert 1 <= node["maxLength"] <= 20, node
            elif t == "string" and "pattern" in node:
                assert node["pattern"].startswith("^") and node["pattern"].endswith("$"), node
            elif t == "number":
                assert "multipleOf" in node, node
            if t in ("integer", "number"):
                assert ("minimum" in node) != ("exclusiveMinimum" in node), node
                assert ("maximum" in node) != ("exclusiveMaximum" in node), node
        sizes.append(sc.max_json_chars(s))
    assert max(sizes) <= sc.MAX_JSON_CHARS == 400
    assert min(sizes) < 40 and sorted(sizes)[len(sizes) // 2] > 60, sizes  # some small, most not trivial


def _features(s: dict) -> set[str]:
    f = set()
    if _container_depth(s) == 3:
        f.add("depth3")
    if s.get("type") == "array":
        f.add("root_array")
    for node, _ in _subschemas(s):
        t = node.get("type")
        if t == "object":
            req = node.get("required", [])
            f.add("required_none" if not req else "required_all" if len(req) == len(node["properties"])
                  else "required_some")
        if "minItems" in node:
            f.add("minItems")
        if t == "array":
            f.add("maxItems")
            if node["items"].get("type") == "object":
                f.add("array_of_objects")
        if "enum" in node:
            kinds = {type(v).__name__ for v in node["enum"]}
            f.add("enum_str" if kinds == {"str"} else "enum_num" if kinds <= {"int", "float"} else "enum_mixed")
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "pattern",
                  "maxLength", "minLength", "anyOf", "const"):
            if k in node:
                f.add(f"{t}:{k}" if k in ("minimum", "maximum", "exclusiveMinimum", "multipleOf") else k)
        if t in ("boolean", "null"):
            f.add(t)
    return f


def test_schemas_cover_the_features():
    counts: dict[str, int] = {}
    for s in SCHEMAS:
        for f in _features(s):
            counts[f] = counts.get(f, 0) + 1
    wanted = ["depth3", "root_array", "required_all", "required_some", "required_none", "minItems", "maxItems",
              "array_of_objects", "enum_str", "enum_num", "enum_mixed", "integer:minimum", "integer:maximum",
              "integer:exclusiveMinimum", "exclusiveMaximum", "integer:multipleOf", "number:minimum",
              "number:exclusiveMinimum", "number:multipleOf", "pattern", "maxLength", "minLength", "anyOf",
              "const", "boolean", "null"]
    missing = {w: counts.get(w, 0) for w in wanted if counts.get(w, 0) < 4}
    assert not missing, (missing, counts)


def test_max_json_chars():
    assert sc.max_json_chars({"type": "string", "maxLength": 3}) == 2 + 3 * 6
    assert sc.max_json_chars({"type": "integer", "minimum": -100, "maximum": 5}) == 4
    assert sc.max_json_chars({"type": "number", "minimum": -2, "maximum": 10, "multipleOf": 0.25}) == 1 + 2 + 3
    assert sc.max_json_chars({"enum": ["café", 1]}) == len('"café"'.encode())
    obj = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"const": None}},
           "additionalProperties": False}
    assert sc.max_json_chars(obj) == len('{"a":false,"b":null}')
    arr = {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
    assert sc.max_json_chars(arr) == len("[false,false,false]")
    assert sc.max_json_chars({"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}) == 10
    for unbounded in [{"type": "string"}, {"type": "object", "properties": {}}, {"type": "array", "items": {}},
                      {"type": "integer", "minimum": 0}, {"type": "number", "minimum": 0, "maximum": 1},
                      {"type": "string", "pattern": "[a-z]{2}"}, {"type": "string", "pattern": '^["]$'}]:
        with pytest.raises(ValueError):
            sc.max_json_chars(unbounded)


def test_examples_validate_and_fit_the_bound():
    rng = random.Random(0)
    for s in SCHEMAS:
        for _ in range(3):
            text = sc.json_example(s, rng)
            sc.validate_json(text, s)
            assert len(text.encode()) <= sc.max_json_chars(s), (text, s)


def test_validate_json_messages():
    s = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["a"], "additionalProperties": False}
    assert sc.validate_json('{"a":3}', s) == {"a": 3}
    for text, needle in [('{"a":10}', "at a: 10 is greater than the maximum"), ('{"a":1', "not valid JSON"),
                         ('{"a":1,"a":2}', "duplicate keys"), ('{"a":NaN}', "NaN is not JSON"),
                         ('{"b":1}', "Additional properties"), ("", "not valid JSON")]:
        with pytest.raises(AssertionError, match=re.escape(needle)):
            sc.validate_json(text, s)


def _regex_ops(tree) -> set[str]:
    """Names of the constructs in a parsed regex (no ANY '.', AT anchors, CATEGORY \\d, NEGATE, GROUPREF,
    ASSERT lookaround, MIN_REPEAT lazy)."""
    ops = set()
    for op, av in tree:
        ops.add(str(op))
        if str(op) == "IN":
            ops |= {str(iop) for iop, _ in av}
        elif str(op) == "MAX_REPEAT":
            ops |= _regex_ops(av[2])
        elif str(op) == "SUBPATTERN":
            assert av[1] == av[2] == 0, "inline flags"
            ops |= _regex_ops(av[3])
        elif str(op) == "BRANCH":
            for sub in av[1]:
                ops |= _regex_ops(sub)
    return ops


def test_regexes_python_side():
    rng = random.Random(0)
    for rx in REGEXES:
        re.compile(rx)
        assert sc.regex_max_len(rx) <= sc.MAX_REGEX_CHARS == 40, rx
        ops = _regex_ops(_sre_p.parse(rx))
        assert ops <= {"LITERAL", "IN", "RANGE", "MAX_REPEAT", "SUBPATTERN", "BRANCH"}, (rx, ops)
        assert not re.search(r"\\[dDwWsSbBAzZ]", rx), rx  # not even inside a class
        for _ in range(5):
            ex = sc.regex_example(rx, rng)
            assert re.fullmatch(rx, ex) and len(ex) <= 40, (rx, ex)
    assert sc.regex_max_len("a{2,5}(bc)?") == 7
    for bad in ["a.b", "[\\d]", "^a", "(?=a)b", "a{1,3}?", "[^a]", "(a)\\1", "(?i:a)"]:
        try:
            ok = _regex_ops(_sre_p.parse(bad)) <= {"LITERAL", "IN", "RANGE", "MAX_REPEAT", "SUBPATTERN", "BRANCH"}
        except AssertionError:
            ok = False
        assert not ok, bad
    assert sc.regex_max_len("a+") > 10**6


def test_choice_lists_shape():
    for lst in CHOICES:
        assert 2 <= len(lst) <= 8 and len(set(lst)) == len(lst) and all(lst), lst
    flat = [c for lst in CHOICES for c in lst]
    assert any(not c.isascii() for c in flat)
    assert any(" " in c for c in flat)
    assert any(re.search(r"[!.'/()\[\]+#,]", c) for c in flat)
    assert any(a != b and b.startswith(a) for lst in CHOICES for a in lst for b in lst)


def test_parse_arith():
    from fractions import Fraction

    assert sc.parse_arith("(1+2)*3") == 9
    assert sc.parse_arith("1+2*3") == 7
    assert sc.parse_arith("8/4/2") == 1
    assert sc.parse_arith("7-2-1") == 4
    assert sc.parse_arith("1/3") == Fraction(1, 3)
    assert sc.parse_arith("(2+(3*4))-5") == 9
    assert sc.parse_arith("1/0") is None and sc.parse_arith("1/(2-2)+1") is None
    assert sc.parse_arith("99") == 99 and sc.parse_arith("0") == 0
    for bad in ["1++2", "", "(1+2", "1+2)", "01", "100", "-1", "1 + 2", "((((1))))", "(((1)))", "()", "1+2+3+4+5",
                "(1+2+3+4)", "((1+2+3+4))", "1+", "*1", "1(2)", "(1)(2)", "1.5"]:
        with pytest.raises(ValueError):
            sc.parse_arith(bad)
    assert sc.parse_arith("((1+2+3))+4") == 10
    longest = "+".join(["(" + "+".join(["(99+99+99)"] * 3) + ")"] * 4)
    assert len(longest) == sc.ARITH_MAX_CHARS == 139
    assert sc.parse_arith(longest) == 99 * 36
    rng = random.Random(0)
    for _ in range(300):
        ex = sc.arith_example(rng)
        sc.parse_arith(ex)
        assert len(ex) <= sc.ARITH_MAX_CHARS


# --------------------------------------------------------------------------------------------------------
# Against llguidance, with the tiny byte-level tokenizer standing in for a model
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llg(tiny_tokenizer):
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf

    return _LLG(llguidance, llguidance.hf.from_tokenizer(tiny_tokenizer), tiny_tokenizer)


class _LLG:
    def __init__(self, llguidance, lltok, tok):
        self.M = llguidance.LLMatcher
        self.lltok = lltok
        self.tok = tok
        import numpy as np

        self.np = np
        # Tokens that end something (a string, number, array, object, member): a "long" walk avoids them.
        first = [lltok.decode_bytes([i])[:1] for i in range(lltok.vocab_size)]
        self.closer = np.array([b in (b"", b'"', b"}", b"]", b",", b")") for b in first])
        self.closer[lltok.eos_token] = True

    def json_grammar(self, schema, compact=True):
        return self.M.grammar_from_json_schema(schema, overrides=sc.COMPACT_JSON_OPTIONS if compact else None)

    def matcher(self, grammar):
        m = self.M(self.lltok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def accepts(self, m, text: str) -> bool:
        m.reset()
        ids = self.tok(text, add_special_tokens=False).input_ids
        if m.validate_tokens(ids) < len(ids):
            return False
        assert m.consume_tokens(ids)
        return m.is_accepting()

    def walk(self, m, rng: random.Random, max_tokens: int, long_bias: float = 0.0) -> str:
        """Sample uniformly among the allowed tokens until the matcher stops or EOS is drawn.

        With probability `long_bias` a step avoids closing tokens when it can, to push outputs to their bound.
        """
        np = self.np
        m.reset()
        out: list[int] = []
        eos = self.lltok.eos_token
        while not m.is_stopped():
            assert len(out) < max_tokens, f"no end after {max_tokens} tokens: {self.lltok.decode_bytes(out)!r}"
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: self.lltok.vocab_size])
            assert len(allowed), "empty mask"
            if long_bias and rng.random() < long_bias:
                open_ = allowed[~self.closer[allowed]]
                allowed = open_ if len(open_) else allowed
            t = int(allowed[rng.randrange(len(allowed))])
            assert m.consume_token(t), m.get_error()
            if t == eos:
                break
            out.append(t)
        assert m.is_accepting() or m.is_stopped()
        return self.lltok.decode_bytes(out).decode("utf-8")


def test_schemas_compile_in_llguidance():
    llguidance = pytest.importorskip("llguidance")
    M = llguidance.LLMatcher
    for s in SCHEMAS:
        assert M.validate_grammar(M.grammar_from_json_schema(s)) == "", s
        assert M.validate_grammar(M.grammar_from_json_schema(s, overrides=sc.COMPACT_JSON_OPTIONS)) == "", s
    for rx in REGEXES:
        assert M.validate_grammar(M.grammar_from_regex(rx)) == "", rx
    assert M.validate_grammar(M.grammar_from_lark(sc.ARITH_LARK)) == ""


def test_schema_examples_accepted_by_llguidance(llg):
    rng = random.Random(1)
    for s in SCHEMAS:
        m, loose = llg.matcher(llg.json_grammar(s)), llg.matcher(llg.json_grammar(s, compact=False))
        for _ in range(2):
            text = sc.json_example(s, rng)
            sc.validate_json(text, s)
            assert llg.accepts(m, text), (text, s)
            assert llg.accepts(loose, text), (text, s)
        if s.get("type") == "object":  # additionalProperties: false, on both sides
            extra = "{" + '"zz_extra":1' + ("," + text[1:] if text != "{}" else "}")
            assert not llg.accepts(m, extra)
            with pytest.raises(AssertionError):
                sc.validate_json(extra, s)
    # The default (flexible) grammar admits unbounded whitespace; the compact one admits none.
    s = SCHEMAS[0]
    text = sc.json_example(s, rng)
    spaced = text[0] + " " * 50 + text[1:]
    assert llg.accepts(llg.matcher(llg.json_grammar(s, compact=False)), spaced)
    assert not llg.accepts(llg.matcher(llg.json_grammar(s)), spaced)


def test_schema_random_walks_validate_within_bound(llg):
    rng = random.Random(2)
    lengths = []
    for s in SCHEMAS:
        bound = sc.max_json_chars(s)
        m = llg.matcher(llg.json_grammar(s))
        for long_bias in (0.0, 0.9):
            text = llg.walk(m, rng, max_tokens=bound + 1, long_bias=long_bias)
            sc.validate_json(text, s)
            assert len(text.encode()) <= bound, (text, s)
            lengths.append(len(text.encode()) / bound)
    assert sorted(lengths)[len(lengths) // 2] > 0.25  # the walks do reach long outputs


def _mutations(s: str, rng: random.Random, alphabet: str, k: int) -> list[str]:
    out = []
    for _ in range(k):
        i = rng.randrange(len(s) + 1)
        c = rng.choice(alphabet)
        op = rng.randrange(4)
        if op == 0 and s:
            out.append(s[: min(i, len(s) - 1)] + s[min(i, len(s) - 1) + 1:])
        elif op == 1:
            out.append(s[:i] + c + s[i:])
        elif op == 2 and i < len(s):
            out.append(s[:i] + c + s[i + 1:])
        else:
            out.append(s + c)
    return out


def test_regex_semantics_agree_with_llguidance(llg):
    rng = random.Random(3)
    for rx in REGEXES:
        m = llg.matcher(llg.M.grammar_from_regex(rx))
        alphabet = "".join(sorted(set(re.sub(r"\\(.)", r"\1", rx)) | set("aZ09-. ")))
        for _ in range(4):
            ex = sc.regex_example(rx, rng)
            assert llg.accepts(m, ex), (rx, ex)
            for mut in _mutations(ex, rng, alphabet, 4):
                assert llg.accepts(m, mut) == bool(re.fullmatch(rx, mut)), (rx, mut)
        for long_bias in (0.0, 0.0, 0.9):
            text = llg.walk(m, rng, max_tokens=sc.MAX_REGEX_CHARS * 4 + 1, long_bias=long_bias)
            assert re.fullmatch(rx, text) and len(text) <= sc.MAX_REGEX_CHARS, (rx, text)


def test_choice_lists_in_llguidance(llg):
    import llguidance

    rng = random.Random(4)
    for lst in CHOICES:
        m = llg.matcher(llguidance.grammar_from("choice", lst))
        for c in lst:
            assert llg.accepts(m, c), (lst, c)
            for bad in (c[:-1], c + "x", c.upper() if c.upper() != c else c + c):
                if bad not in lst:
                    assert not llg.accepts(m, bad), (lst, bad)
        for _ in range(3):
            assert llg.walk(m, rng, max_tokens=64) in lst


def test_arith_lark_in_llguidance(llg):
    m = llg.matcher(llg.M.grammar_from_lark(sc.ARITH_LARK))
    assert llg.accepts(m, "(1+2)*3") and sc.parse_arith("(1+2)*3") == 9
    assert not llg.accepts(m, "1++2")
    longest = "+".join(["(" + "+".join(["(99+99+99)"] * 3) + ")"] * 4)
    assert llg.accepts(m, longest)
    for bad in ["", "1+2+3+4+5", "(((1)))", "01", "(1+2", "1 +2", longest + "+1", "-1"]:
        assert not llg.accepts(m, bad), bad
    rng = random.Random(5)
    for _ in range(60):
        ex = sc.arith_example(rng)
        assert llg.accepts(m, ex), ex
        for mut in _mutations(ex, rng, "0123456789+-*/()", 3):
            try:
                sc.parse_arith(mut)
                ok = True
            except ValueError:
                ok = False
            assert llg.accepts(m, mut) == ok, mut
    for i in range(40):
        text = llg.walk(m, rng, max_tokens=sc.ARITH_MAX_CHARS + 1, long_bias=0.9 if i % 2 else 0.0)
        sc.parse_arith(text)
        assert len(text) <= sc.ARITH_MAX_CHARS
