"""The static limits a grammar must meet before llguidance sees it: pure Python, iterative checks of regexes,
Lark and GBNF grammars and JSON schemas. Over one is a ValueError naming it.

llguidance compiles grammars recursively, and a deep enough grammar overflows the thread's stack: the
process dies with SIGSEGV, no exception and no traceback. Measured with llguidance 1.9.1 on an 8 MiB
stack (`LLMatcher.validate_grammar` and `LLMatcher(tokenizer, ...)` die at the same sizes; the Lark and
JSON texts are only wrapped by `grammar_from_*`, the compile is what recurses):

- Lark rules that each reference the next (`r{i}: "x" r{i+1} | "y"`): fine at 2,664, dead at 2,742;
  the same chain of terminals (`T{i}: "x" T{i+1}`): dead at ~3,600.
- JSON schema `$ref` chains (`$defs` d{i} -> d{i+1}, one property deep each): fine at 906, dead at 945.
- JSON schema nesting without `$ref`: dead at ~9,000 nested objects (~18,000 containers), ~17,500 arrays.
- Parenthesis nesting inside one Lark rule and group nesting in a regex are refused by llguidance itself
  (at 29 and ~130 levels), with an error, not a crash.

So a $ref costs the stack about as much as 20 levels of nesting, and the limits below sit an order of
magnitude under the crash. `grammar.to_grammar` runs them (check_grammar_text, check_json_schema,
check_regex) on both paths that make grammar text (the caller's `validate` and the core's compile), so the
core only ever compiles grammars that passed them. What they miss, isolation.py and threads.py catch.
"""
from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

# ---- limits (see the measurements above) ---------------------------------------------------------------
# Rules and terminals in a Lark or GBNF grammar. Bounds the work of checking and converting (GBNF -> Lark
# is Python, quadratic in the worst case); a flat grammar of 5,000 rules compiles in 0.3 s.
MAX_GRAMMAR_RULES = 2000
# The longest chain of rule references, each rule counting 1 + its bracket nesting, and a group of rules
# that reference each other (a recursive grammar) counting all its members. Crash: ~2,700; 9x under it.
MAX_GRAMMAR_DEPTH = 300
# Brackets nested inside one rule; llguidance refuses more than 28 itself (with an unhelpful message).
MAX_GRAMMAR_NESTING = 24
# Groups nested in a regex (the regex kind, Lark /.../ literals, JSON "pattern"); llguidance refuses
# ~130 itself. Length is bounded by MAX_GRAMMAR_BYTES: a 225 KB regex of alternatives compiles in 0.3 s.
MAX_REGEX_NESTING = 64
# Objects and arrays nested in a JSON schema document (a property is two: its object and `properties`).
MAX_JSON_NESTING = 128
# The deepest path through a JSON schema, counting each object or array 1 and each $ref followed
# JSON_REF_COST (so ~45 chained $refs). Crash: ~18,000 on the same scale; 18x under it.
JSON_REF_COST = 20
MAX_JSON_DEPTH = 1000
# Named subschemas (entries of properties, patternProperties, $defs and definitions) in one schema:
# 2,000 optional properties compile in ~1 s against a tokenizer.
MAX_JSON_PROPERTIES = 2000


# ---- regexes --------------------------------------------------------------------------------------------
def check_regex(rx: str, what: str = "the regex") -> None:
    """ValueError when the regex nests groups deeper than MAX_REGEX_NESTING."""
    depth = deepest = klass = 0
    i, n = 0, len(rx)
    while i < n:
        c = rx[i]
        if c == "\\":
            i += 2
            continue
        if klass:
            klass += c == "["  # Rust regex classes nest: [a-z&&[^x]]
            klass -= c == "]"
        elif c == "[":
            klass = 1
            i += 1 + rx.startswith("^", i + 1)
            i += rx.startswith("]", i)  # a leading ] is a literal
            continue
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1
    if deepest > MAX_REGEX_NESTING:
        raise ValueError(f"{what} nests groups {deepest} deep; the limit is {MAX_REGEX_NESTING}.")


# ---- Lark and GBNF grammars -------------------------------------------------------------------------------
# Tokens of llguidance's Lark (parser/src/lark/lexer.rs): comments are # or //, strings JSON strings with an
# optional i flag, regexes /.../flags; %json, %regex and %llguidance are followed by a JSON value.
_LARK = re.compile(r"""
    (?P<skip>[ \t\r]+|(?:\#|//)[^\n]*)
  | (?P<nl>\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\])+/[imslux]*)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<name>[!?]?_?[A-Za-z][\w\-]*)
  | (?P<open>[(\[{])
  | (?P<close>[)\]}])
  | (?P<other>.)
""", re.X | re.S)
# After a name at the start of a line: template parameters, a priority, then ":" make it a definition.
_LARK_DEF = re.compile(r"[ \t]*(?:\{[^}\n]*\})?[ \t]*(?:\.[ \t]*[+-]?\d+)?[ \t]*:(?!:)")
# llama.cpp's GBNF: `name ::= ...`, # comments, strings, [character classes], ( ) groups.
_GBNF = re.compile(r"""
    (?P<skip>[ \t\r]+|\#[^\n]*)
  | (?P<nl>\n)
  | (?P<string>"(?:\\.|[^"\\\n])*")
  | (?P<cls>\[(?:\\.|[^\]\\])*\])
  | (?P<name>[\w\-]+)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<other>.)
""", re.X | re.S)
_GBNF_DEF = re.compile(r"[ \t]*::=")
_JSON = json.JSONDecoder()


class _Rules:
    """Definitions as they are scanned: name -> [weight (1 + deepest bracket nesting), referenced names]."""

    def __init__(self) -> None:
        self.defs: dict[str, list] = {}
        self.current: list | None = None
        self.depth = 0

    def define(self, name: str) -> None:
        self.current = self.defs.setdefault(name.lstrip("!?"), [1, []])
        self.depth = 0
        if len(self.defs) > MAX_GRAMMAR_RULES:
            raise ValueError(f"the grammar has more than {MAX_GRAMMAR_RULES} rules and terminals; "
                             f"the limit is {MAX_GRAMMAR_RULES}.")

    def open(self) -> None:
        self.depth += 1
        if self.depth > MAX_GRAMMAR_NESTING:
            raise ValueError(f"the grammar nests brackets more than {MAX_GRAMMAR_NESTING} deep in one rule; "
                             f"the limit is {MAX_GRAMMAR_NESTING}.")
        if self.current is not None:
            self.current[0] = max(self.current[0], 1 + self.depth)

    def close(self) -> None:
        self.depth = max(0, self.depth - 1)

    def ref(self, name: str) -> None:
        if self.current is not None:
            self.current[1].append(name.lstrip("!?"))


def check_grammar_text(text: str) -> None:
    """ValueError when a Lark or GBNF grammar has too many rules, nests too deep in a rule, references
    rules in too long a chain, or holds a regex or a %json schema over its limits."""
    from llguidance.gbnf_to_lark import is_lark_syntax

    rules = _Rules()
    if is_lark_syntax(text):
        _scan_lark(text, rules)
    else:
        _scan_gbnf(text, rules)
    weights = {name: d[0] for name, d in rules.defs.items()}
    edges = {name: d[1] for name, d in rules.defs.items()}
    depth = longest_chain(weights, edges)
    if depth > MAX_GRAMMAR_DEPTH:
        raise ValueError(f"the grammar's rules reference each other {depth} deep (the longest chain of rules "
                         f"each using the next, a recursive group counting all its rules, plus bracket "
                         f"nesting); the limit is {MAX_GRAMMAR_DEPTH}.")


def _scan_lark(text: str, rules: _Rules) -> None:
    pos, line_start = 0, True
    while pos < len(text):
        m = _LARK.match(text, pos)
        kind, pos = m.lastgroup, m.end()
        if kind == "skip":
            continue
        if kind == "nl":
            line_start = True
            continue
        first, line_start = line_start, False
        if kind == "name":
            d = _LARK_DEF.match(text, pos) if first else None
            if d:
                rules.define(m.group())
                pos = d.end()
            else:
                rules.ref(m.group())
        elif kind == "open":
            rules.open()
        elif kind == "close":
            rules.close()
        elif kind == "regex":
            check_regex(m.group()[1:m.group().rindex("/")], "a regex in the grammar")
        elif kind == "directive":
            if first:
                rules.current = None  # %ignore, %import, ...: not part of a rule
            if m.group() in ("%json", "%regex", "%llguidance"):
                pos = _skip_json(text, pos, check=m.group() == "%json")


def _skip_json(text: str, pos: int, check: bool) -> int:
    """Past the JSON value after a %json/%regex/%llguidance directive (checked as a schema for %json)."""
    start = pos
    while start < len(text) and text[start] in " \t\r\n":
        start += 1
    try:
        value, end = _JSON.raw_decode(text, start)
    except RecursionError:
        raise ValueError(f"a %json schema in the grammar nests more than {MAX_JSON_NESTING} deep; "
                         f"the limit is {MAX_JSON_NESTING}.") from None
    except ValueError:
        return pos  # not JSON: llguidance reports it
    if check:
        check_json_schema(value, "the %json schema in the grammar")
    return end


def _scan_gbnf(text: str, rules: _Rules) -> None:
    pos = 0
    while pos < len(text):
        m = _GBNF.match(text, pos)
        kind, pos = m.lastgroup, m.end()
        if kind == "name":
            d = _GBNF_DEF.match(text, pos)
            if d:
                rules.define(m.group())
                pos = d.end()
            else:
                rules.ref(m.group())
        elif kind == "open":
            rules.open()
        elif kind == "close":
            rules.close()


def longest_chain(weights: dict[Any, int], edges: dict[Any, list]) -> int:
    """The heaviest path through a directed graph, a strongly connected group (mutual recursion) counting
    the weights of all its members: an upper bound on how deep a depth-first compile can recurse.
    Iterative Tarjan; groups come out sinks first, so each one's successors are already summed."""
    index: dict[Any, int] = {}
    low: dict[Any, int] = {}
    group: dict[Any, int] = {}
    best: list[int] = []  # per group: the heaviest path starting in it
    stack: list = []
    on_stack: set = set()
    for root in weights:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(edges.get(root, ())))]
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in weights:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(edges.get(nxt, ()))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        members.append(m)
                        if m == node:
                            break
                    gid = len(best)
                    for m in members:
                        group[m] = gid
                    after = max((best[group[n]] for m in members for n in edges.get(m, ())
                                 if n in group and group[n] != gid), default=0)
                    best.append(sum(weights[m] for m in members) + after)
    return max(best, default=0)


# ---- JSON schemas ---------------------------------------------------------------------------------------
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def check_json_schema(schema: Any, what: str = "the JSON schema") -> None:
    """ValueError when a JSON schema nests too deep, has too many properties and definitions, chains $refs
    too deep, or has a pattern over the regex limits. One iterative walk; the $ref graph only if it has any."""
    weights: dict[int, int] = {}
    edges: dict[int, list[int]] = {}
    refs: list[tuple[int, str]] = []
    anchors: dict[str, Any] = {}
    named = 0
    todo: list[tuple[Any, int, str | None]] = [(schema, 1, None)] if isinstance(schema, (dict, list)) else []
    while todo:
        value, depth, key = todo.pop()
        if depth > MAX_JSON_NESTING:
            raise ValueError(f"{what} nests objects and arrays more than {MAX_JSON_NESTING} deep; "
                             f"the limit is {MAX_JSON_NESTING}.")
        node = id(value)
        weights[node] = 1
        kids = edges[node] = []
        if isinstance(value, dict):
            if key in _NAMED:
                named += len(value)
                if named > MAX_JSON_PROPERTIES:
                    raise ValueError(f"{what} has more than {MAX_JSON_PROPERTIES} properties and definitions; "
                                     f"the limit is {MAX_JSON_PROPERTIES}.")
                if key == "patternProperties":
                    for rx in value:
                        check_regex(rx, f"a patternProperties regex in {what}")
            if isinstance(value.get("$ref"), str):
                refs.append((node, value["$ref"]))
                weights[node] += JSON_REF_COST
            if isinstance(value.get("$anchor"), str):
                anchors["#" + value["$anchor"]] = value
            items = value.items()
        else:
            items = ((None, v) for v in value)
        for k, v in items:
            if isinstance(v, (dict, list)):
                kids.append(id(v))
                todo.append((v, depth + 1, k))
            elif k == "pattern" and isinstance(v, str):
                check_regex(v, f"a pattern in {what}")
    if not refs:
        return  # the depth is the nesting, already within its limit
    for node, ref in refs:
        target = _resolve(schema, ref, anchors)
        if isinstance(target, (dict, list)):
            edges[node].append(id(target))
    depth = longest_chain(weights, edges)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{what} is {depth} deep counting its $ref chains (each object or array 1, each $ref "
                         f"followed {JSON_REF_COST}, a recursive group counting all its members); "
                         f"the limit is {MAX_JSON_DEPTH}.")


def _resolve(root: Any, ref: str, anchors: dict[str, Any]) -> Any:
    """The local target of a $ref ("#", "#/json/pointer", "#anchor"); None for remote or unknown ones."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return anchors.get(ref)
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
