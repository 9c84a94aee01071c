"""Grammars cannot take the process down, and constrained JSON cannot run away (issue 24, items 0, 4 and 6).

- Limits (structured_output/limits.py) refuse, with a ValueError naming the limit, the grammars whose
  compile overflows llguidance's stack (the issue's 3,000 chained Lark rules killed the API process),
  on both paths that make grammar text: the caller's `validate` and the core's `to_grammar`.
- What slips past the limits costs a worker process, not this one (`check_isolated`); the core compiles
  on threads with a stack 8x the worker's; a compile whose requests were all aborted is still cached.
- Integers and numbers that a schema leaves unbounded are bounded (fed digit by digit through a matcher).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import llguidance
import llguidance.hf
import pytest

from tiny import build_tokenizer
from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.serve.tools import ConstrainedToolStream, tool_choice_schema
from tokenmill.structured_output import checker, isolation
from tokenmill.structured_output.grammar import (JSON_INT_BOUND, JSON_NUMBER_BOUND, bound_numbers, to_grammar,
                                                 validate)
from tokenmill.structured_output.manager import StructuredOutputManager

SO = StructuredOutputsParams
pytestmark = pytest.mark.timeout(300)


# ---- shapes --------------------------------------------------------------------------------------------------
def chained(n: int) -> str:
    """The issue's grammar: start -> r0 -> r1 -> ... -> r{n}, each rule using the next."""
    return "\n".join(["start: r0"] + [f'r{i}: "x{i}" r{i + 1} | "y{i}"' for i in range(n)] + [f'r{n}: "z"'])


def gbnf_chained(n: int) -> str:
    return "\n".join(["root ::= r0"] + [f'r{i} ::= "x" r{i + 1} | "y"' for i in range(n)] + [f'r{n} ::= "z"'])


def recursive_group(n: int) -> str:
    """n rules that all reach each other (a cycle): one strongly connected group."""
    return "\n".join(["start: r0"] + [f'r{i}: "a" r{(i + 1) % n} | "b"' for i in range(n)])


def nested_schema(levels: int) -> dict:
    s: dict = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"], "additionalProperties": False}
    return s


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "boolean"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_regex(n: int) -> str:
    return "(a" * n + ")" * n


# ---- limits: a ValueError naming the limit, on the caller's path and the core's ----------------------------
OVER = [
    ("issue grammar, 3000 chained rules", SO(grammar=chained(3000)), "limit is 2000"),
    ("400 chained rules", SO(grammar=chained(400)), "reference each other 402 deep.*limit is 300"),
    ("400 chained GBNF rules", SO(grammar=gbnf_chained(400)), "limit is 300"),
    ("a recursive group of 400 rules", SO(grammar=recursive_group(400)), "limit is 300"),
    ("brackets 30 deep in a rule", SO(grammar="start: " + '("a" ' * 30 + '"b"' + ")" * 30), "limit is 24"),
    ("regex groups 100 deep", SO(regex=nested_regex(100)), "nests groups 100 deep.*limit is 64"),
    ("a Lark regex 100 deep", SO(grammar=f"start: /{nested_regex(100)}/"), "limit is 64"),
    ("JSON schema 100 objects deep", SO(json=nested_schema(100)), "more than 128 deep.*limit is 128"),
    ("JSON schema text 5000 deep", SO(json='{"a":' * 5000 + "1" + "}" * 5000), "limit is 128"),
    ("60 chained $refs", SO(json=ref_chain(60)), r"counting its \$ref chains.*limit is 1000"),
    ("2500 properties", SO(json={"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(2500)}}),
     "limit is 2000"),
    ("a pattern 100 deep", SO(json={"type": "string", "pattern": nested_regex(100)}), "limit is 64"),
    ("a %json schema in a grammar", SO(grammar="start: %json " + json.dumps(nested_schema(100))), "limit is 128"),
    ("a structural tag's schema", SO(structural_tag={"triggers": ["<f>"], "structures": [
        {"begin": "<f>", "schema": nested_schema(100), "end": "</f>"}]}), "limit is 128"),
]


@pytest.mark.parametrize("so,message", [(so, m) for _, so, m in OVER], ids=[name for name, _, _ in OVER])
def test_over_a_limit_is_a_value_error_naming_it(so, message):
    with pytest.raises(ValueError, match=f"(?s){message}"):
        to_grammar(so)  # the core's path
    with pytest.raises(ValueError, match=f"(?s){message}"):
        validate(so)  # the caller's


def test_the_issue_grammar_is_the_issue_size():
    assert 88_000 < len(chained(3000)) < 89_000 < 256 * 1024  # 88.6 KB: under MAX_GRAMMAR_BYTES


UNDER = [
    SO(grammar=chained(250)),
    SO(grammar=gbnf_chained(250)),
    SO(grammar=recursive_group(100)),
    SO(grammar='start: expr\nexpr: term ("+" term)*\nterm: NUM | "(" expr ")"\nNUM: /[0-9]{1,3}/'),
    SO(grammar="start: " + '("a" ' * 20 + '"b"' + ")" * 20),
    SO(regex=nested_regex(60)),
    SO(json=nested_schema(60)),
    SO(json=ref_chain(30)),
    SO(json={"$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}}, "$ref": "#/$defs/node"}),
    SO(json={"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(500)}}),
]


@pytest.mark.parametrize("so", UNDER, ids=range(len(UNDER)))
def test_under_the_limits_compiles(so):
    validate(so)  # no ValueError


# ---- what slips past the limits costs a worker process ----------------------------------------------------
@pytest.fixture(scope="module")
def crashing_grammar() -> str:
    """llguidance's own text for the issue's grammar, limits bypassed: its compile overflows an 8 MiB stack."""
    return llguidance.grammar_from("grammar", chained(3000))


def test_a_crashing_check_costs_only_the_worker(crashing_grammar):
    ok = to_grammar(SO(regex="[a-z]{3}"))
    assert checker.check_isolated(ok, 60) == ""
    error = checker.check_isolated(crashing_grammar, 60)
    assert "crashed the grammar checker" in error, error
    assert checker.check_isolated(ok, 60) == ""  # a new worker
    assert "unclosed group" in checker.check_isolated(llguidance.LLMatcher.grammar_from_regex("(x"), 60)


def test_a_check_past_its_timeout_kills_the_worker_only():
    ok = to_grammar(SO(regex="[0-9]{2}"))
    assert "did not compile within" in checker.check_isolated(ok, 0)
    assert checker.check_isolated(ok, 60) == ""


def test_a_worker_that_died_idle_is_replaced():
    ok = to_grammar(SO(regex="[a-c]{2}"))
    assert checker.check_isolated(ok, 60) == ""
    for w in list(isolation._pool._idle):
        w.proc.kill()
        w.proc.wait(10)
    assert checker.check_isolated(ok, 60) == ""


def test_without_worker_processes_on_this_platform_the_check_runs_here(monkeypatch):
    """Only a platform with no worker processes at all (os.name != "posix") checks on a thread here."""
    monkeypatch.setattr(isolation, "IN_PROCESS", True)
    assert checker.check_isolated(to_grammar(SO(regex="[a-z]")), 60) == ""
    assert "unclosed group" in checker.check_isolated(llguidance.LLMatcher.grammar_from_regex("(x"), 60)
    assert checker.checker_status().state == "in_process"


CHECK_ON_A_STACK = """
import sys, llguidance
from tokenmill.structured_output.checker import StackPool, {stack}
grammar = llguidance.grammar_from("grammar", sys.stdin.read())
print(repr(StackPool(1, {stack}, "t").submit(llguidance.LLMatcher.validate_grammar, grammar).result(120)))
"""


def test_the_crash_is_real_and_the_compile_stack_takes_it():
    """Why the limits and the worker exist: on an 8 MiB stack the issue's grammar kills the process, with no
    exception; on the core's compile stack (8x) it compiles."""
    if not llguidance.__version__.startswith("1.9"):
        pytest.skip(f"the crash was measured on llguidance 1.9, this is {llguidance.__version__}")
    for stack, dies in (("CHECK_STACK_BYTES", True), ("COMPILE_STACK_BYTES", False)):
        run = subprocess.run([sys.executable, "-c", CHECK_ON_A_STACK.format(stack=stack)], input=chained(3000),
                             capture_output=True, text=True, timeout=240)
        if dies:
            assert run.returncode < 0, run  # killed by a signal (SIGSEGV)
        else:
            assert run.returncode == 0 and run.stdout.strip() == "''", run


# ---- the core's manager ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_tok():
    return build_tokenizer()


@pytest.fixture
def manager(hf_tok):
    mgr = StructuredOutputManager(lambda: hf_tok, len(hf_tok), lambda: [hf_tok.eos_token_id])
    yield mgr
    mgr.shutdown()


def _req(rid: str, so: StructuredOutputsParams):
    return SimpleNamespace(request_id=rid, params=SimpleNamespace(structured_outputs=so), grammar=None,
                           output_token_ids=[])


def _poll_until(mgr, cond, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    failed: list = []
    while True:
        failed += mgr.poll()
        if cond(failed):
            return failed
        assert time.monotonic() < deadline, "the compile did not finish in time"
        mgr.wait(0.5)


def test_the_core_refuses_a_grammar_over_a_limit(manager):
    bad, good = _req("bad", SO(grammar=chained(3000))), _req("good", SO(regex="[a-z]{2}"))
    manager.add(bad)
    manager.add(good)
    failed = _poll_until(manager, lambda f: bad in f and good.grammar.matcher is not None)
    assert failed == [bad] and "limit is 2000" in bad.grammar.error


def test_a_compile_whose_requests_were_all_aborted_is_cached(manager, monkeypatch):
    """Issue 24 item 4: freeing every request that waited on a compile left it in `_compiling` forever and
    its result uncached."""
    import threading

    release = threading.Event()
    original = manager._compile

    def gated(grammar):
        assert release.wait(60), "the test never released the compile"
        return original(grammar)

    monkeypatch.setattr(manager, "_compile", gated)
    so = SO(regex="abort[0-9]{2}")
    first = _req("first", so)
    manager.add(first)
    future = first.grammar.future
    manager.free(first)  # aborted while compiling
    assert manager.poll() == [] and manager.num_compiling == 0
    release.set()
    future.result(timeout=60)
    assert manager.poll() == []
    assert not manager._compiling and so.spec() in manager._cache
    hits = manager.stats.cache_hits
    again = _req("again", so)
    manager.add(again)
    assert manager.stats.cache_hits == hits + 1 and again.grammar.matcher is not None


# ---- bounded numbers: fed digit by digit through llguidance's matcher --------------------------------------
@pytest.fixture(scope="module")
def lltok(hf_tok):
    return llguidance.hf.from_tokenizer(hf_tok, n_vocab=len(hf_tok))


def accepted(lltok, so: StructuredOutputsParams, text: str) -> int:
    """How many characters of `text` the constraint's matcher takes, one character at a time."""
    m = llguidance.LLMatcher(lltok, to_grammar(so), log_level=0)
    assert not m.is_error(), m.get_error()
    for i, ch in enumerate(text):
        if not m.consume_tokens(lltok.tokenize_str(ch)):
            return i
    return len(text)


def complete(lltok, so: StructuredOutputsParams, text: str) -> bool:
    m = llguidance.LLMatcher(lltok, to_grammar(so), log_level=0)
    return m.consume_tokens(lltok.tokenize_str(text)) and m.is_accepting()


INT = SO(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
         disable_any_whitespace=True)
NUM = SO(json={"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
         disable_any_whitespace=True)


def test_an_unbounded_integer_stops_at_19_digits(lltok):
    head = '{"n":'
    assert accepted(lltok, INT, head + "1" * 40) == len(head) + 19  # the 20th digit is refused
    assert accepted(lltok, INT, head + "-" + "1" * 40) == len(head) + 20
    assert complete(lltok, INT, head + "1" * 19 + "}")
    assert complete(lltok, INT, head + str(JSON_INT_BOUND) + "}")
    assert complete(lltok, INT, head + str(-JSON_INT_BOUND) + "}")
    assert accepted(lltok, INT, head + "9" * 19) < len(head) + 19  # 19 digits, but past int64


def test_an_unbounded_number_stops(lltok):
    head = '{"x":'
    assert accepted(lltok, NUM, head + "1" * 40) == len(head) + 15  # 16 digits would pass 10**15
    assert accepted(lltok, NUM, head + "0." + "3" * 40) == len(head) + 2 + 10  # 10 digits after the point
    assert complete(lltok, NUM, head + str(JSON_NUMBER_BOUND) + "}")
    assert complete(lltok, NUM, head + "-123456789012345.1234567891}")
    assert complete(lltok, NUM, head + "2.5}")
    assert accepted(lltok, NUM, head + "1e5") == len(head) + 1  # no exponent


def test_a_schema_keeps_its_own_bounds(lltok):
    own = SO(json={"type": "integer", "minimum": 0}, disable_any_whitespace=True)
    assert accepted(lltok, own, "-1") == 0  # its minimum holds
    assert accepted(lltok, own, "1" * 40) == 19  # and ours caps the other side
    step = SO(json={"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}, disable_any_whitespace=True)
    assert complete(lltok, step, "0.75") and not complete(lltok, step, "0.7")
    small = SO(json={"type": "number", "maximum": 1, "exclusiveMinimum": 0}, disable_any_whitespace=True)
    assert complete(lltok, small, "0.5") and accepted(lltok, small, "0." + "1" * 20) == 12
    # Only subschemas get bounds, never data (const, enum, default, examples).
    data = {"type": "integer", "const": 3, "default": {"type": "integer"}, "examples": [{"type": "number"}]}
    assert bound_numbers(json.loads(json.dumps(data))) == data
    assert bound_numbers({"type": ["integer", "null"]})["maximum"] == JSON_INT_BOUND


def test_json_object_numbers_are_bounded(lltok):
    any_obj = SO(json_object=True, disable_any_whitespace=True)
    assert complete(lltok, any_obj, '{"a":{"b":[1,2.5,null,"x",true]},"c":-3}')
    head = '{"a":['
    assert accepted(lltok, any_obj, head + "1" * 40) == len(head) + 19


def test_tool_call_arguments_are_bounded(lltok):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
    so = SO(json=tool_choice_schema(tools, "required"), disable_any_whitespace=True)
    head = '[{"name":"f","parameters":{"n":'
    assert accepted(lltok, so, head + "7" * 40) == len(head) + 19
    tag = SO(structural_tag={"triggers": ["@f("], "structures": [
        {"begin": "@f(", "schema": {"type": "integer"}, "end": ")"}]})
    assert accepted(lltok, tag, "@f(" + "5" * 40) == 3 + 19


# ---- end to end on the real SmolLM2, the issue's two runaways ---------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    from tokenmill.model.default import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from tokenmill import LLM

    llm = LLM(None, max_model_len=1024, kv_cache_memory_bytes=1 << 28)
    yield llm
    llm.engine.shutdown()


@pytest.mark.slow
def test_smollm2_writes_a_bounded_integer(smol):
    """Asked for pi's digits, the model would write digits until max_tokens; the bound closes the JSON."""
    schema = {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"],
              "additionalProperties": False}
    ask = "Write the digits of pi as one integer, as many as you know: 31415926535897932384626433832795"
    out = smol.chat([[{"role": "user", "content": ask}]],
                    SamplingParams(temperature=0, max_tokens=120, structured_outputs=SO(json=schema)),
                    use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text  # closed before max_tokens
    value = json.loads(out.text)["value"]
    assert 10 <= len(str(abs(value))) <= 19 and abs(value) <= JSON_INT_BOUND, out.text


@pytest.mark.slow
def test_smollm2_required_tool_calls_cut_by_max_tokens(smol):
    """At temperature 0 the model writes calls until max_tokens: the complete ones come back, the cut one
    is not content."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}}}]
    schema = tool_choice_schema(tools, "required")
    ask = "What is the weather in Paris, London, Rome, Oslo and Madrid?"
    out = smol.chat([[{"role": "user", "content": ask}]],
                    SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=schema)),
                    use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length", out.text
    got = ConstrainedToolStream("required").extract(out.text)
    assert got.content is None and got.tool_calls, out.text
    for call in got.tool_calls:
        assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
