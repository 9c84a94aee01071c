"""Keeping grammars from taking a process down: limits checked before llguidance sees a grammar, the
caller's compile check in a worker process, and threads with a known stack for the compiles that stay in
process.

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
magnitude under the crash. Three layers, so that what one misses the next catches:
1. Limits (check_grammar_text, check_json_schema, check_regex): pure Python, iterative, run by
   `grammar.to_grammar` on both paths that make grammar text (the caller's `validate` and the core's
   compile), so the core only ever compiles grammars that passed them. Over one is a ValueError naming it.
2. `check_isolated`: the caller's llguidance check runs in a worker process (on an 8 MiB thread), killed
   when it dies or overruns its timeout: whatever slips past the limits costs that request a 400. A worker
   that cannot start is retried with backoff while grammar requests get 503 (`CheckerUnavailable`); the
   check never falls back into the server's process (only a platform without worker processes checks here).
3. `StackPool`: the core compiles on threads with a 64 MiB stack, 8x the worker's, so a grammar that
   passed the worker's check also compiles in the core.

Run as a script, this file is the worker (it imports only the standard library and llguidance).
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import unquote

log = logging.getLogger(__name__)

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

# ---- the worker -------------------------------------------------------------------------------------
CHECK_WORKERS = 2  # worker processes (checks run in parallel up to this)
CHECK_STACK_BYTES = 8 << 20  # the worker's check thread: the stack the limits were measured on
COMPILE_STACK_BYTES = 64 << 20  # compile threads in the core: 8x the check's, so what passed compiles
WORKER_MEMORY_BYTES = 4 << 30  # the worker's address space: a grammar that needs more kills only it
WORKER_START_TIMEOUT_S = 30.0


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


# ---- threads with a chosen stack ----------------------------------------------------------------------------
_stack_lock = threading.Lock()


def start_thread(target: Callable[[], None], name: str, stack_bytes: int) -> threading.Thread:
    """A daemon thread with a `stack_bytes` stack (threading.stack_size is process-wide: set, start, restore)."""
    with _stack_lock:
        try:
            old = threading.stack_size(stack_bytes)
        except (ValueError, RuntimeError):  # a platform that cannot: the default stack
            old = None
        try:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
        finally:
            if old is not None:
                threading.stack_size(old)
    return t


class StackPool:
    """A fixed set of threads with a chosen stack size, ThreadPoolExecutor's submit/shutdown (the threads
    start on the first submit)."""

    def __init__(self, workers: int, stack_bytes: int, name: str) -> None:
        self._workers, self._stack, self._name = workers, stack_bytes, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        with self._lock:
            if not self._started:
                for i in range(self._workers):
                    start_thread(self._run, f"{self._name}-{i}", self._stack)
                self._started = True
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller's future carries it
                future.set_exception(e)

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        while cancel_futures:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self._workers if self._started else 0):
            self._queue.put(None)


# ---- the isolated check ---------------------------------------------------------------------------------
# A worker that failed to start is tried again after the first value, doubling up to the second: a host out of
# processes or file descriptors is not hammered, and one that recovers gets its checks back within a minute.
RESTART_BACKOFF_S = (1.0, 60.0)
# No worker processes at all on this platform: the checks run on threads here (the only in-process checks).
IN_PROCESS = os.name != "posix"


class CheckerUnavailable(RuntimeError):
    """No worker can check the grammar now (one is being restarted, or all are busy): the caller answers 503
    with Retry-After. Never a check in this process, and never a verdict to cache."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = max(1.0, retry_after_s)


@dataclass
class CheckerStatus:
    state: str  # "ok" | "restarting" (a worker could not start; retried with backoff) | "in_process"
    start_failures: int  # failed worker starts since this process began
    retry_in_s: float = 0.0  # restarting: until the next try
    last_error: str | None = None


class _Died(Exception):
    pass


class _Worker:
    """One checker process: a JSON line with a grammar in, a JSON line with llguidance's verdict out.
    OSError when it cannot start (no process, no file descriptors, no ready line within `start_timeout`)."""

    def __init__(self, command: list[str], start_timeout: float) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, bufsize=0)
        self._buf = b""
        try:
            ready = self._read_line(time.monotonic() + start_timeout)
        except (_Died, ValueError):
            ready = None
        if ready != {"ready": True}:
            self.kill()
            raise OSError(f"the grammar checker process did not start within {start_timeout:g} s")

    def check(self, grammar: str, deadline: float) -> str:
        """llguidance's error ("" when valid); _Died when the process died or overran the deadline."""
        try:
            self.proc.stdin.write(json.dumps({"grammar": grammar}).encode() + b"\n")
        except OSError:
            raise _Died(f"exit code {self.proc.poll()}") from None
        return self._read_line(deadline)["error"]

    def _read_line(self, deadline: float) -> dict:
        import select

        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Died("timeout")
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise _Died(f"exit code {self.proc.wait(5)}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill that does not take
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class CheckerPool:
    """Up to `workers` checker processes, one check each at a time.

    A worker that crashes or overruns its check's deadline is killed, so a hanging grammar holds a worker for
    its timeout, never for good; the next check starts a new one. A worker that cannot start turns the pool
    "restarting": a thread of its own tries again with backoff, and meanwhile every check raises
    CheckerUnavailable at once. Checks never fall back into this process: the crash the workers exist to
    contain would take the server down."""

    def __init__(self, workers: int = CHECK_WORKERS, command: list[str] | None = None,
                 start_timeout: float = WORKER_START_TIMEOUT_S, backoff: tuple[float, float] = RESTART_BACKOFF_S):
        self.workers = workers
        self.command = command or [sys.executable, os.path.abspath(__file__)]
        self.start_timeout = start_timeout
        self.backoff = backoff
        self._slots = threading.BoundedSemaphore(workers)
        self._cond = threading.Condition()  # guards everything below
        self._idle: list[_Worker] = []
        self._restarting = False
        self._restarter: threading.Thread | None = None
        self._retry_at = 0.0
        self._streak = 0  # failed starts in a row
        self._error: str | None = None
        self._closed = False
        self.start_failures = 0

    # ---- what callers use ------------------------------------------------------------------
    def check(self, grammar: str, timeout: float) -> str:
        """llguidance's check of `grammar` ("" valid, else the error) in a worker, within `timeout`: a grammar
        that crashes or hangs the check costs that worker, never this process. CheckerUnavailable when no
        worker can take it (restarting, or all busy for the whole timeout)."""
        self._refuse_while_restarting()
        if not self._slots.acquire(timeout=timeout):
            raise CheckerUnavailable(f"all {self.workers} grammar checkers stayed busy for {timeout:g} s.")
        try:
            worker = self._take()
            deadline = time.monotonic() + timeout  # the check's own time: a slow start is not the grammar's fault
            try:
                error = worker.check(grammar, deadline)
            except _Died as e:
                worker.kill()
                if str(e) == "timeout":
                    return f"it did not compile within {timeout:g} s."
                return f"checking it crashed the grammar checker ({e}); it is too large or too deeply nested."
            with self._cond:
                self._idle.append(worker)
            return error
        finally:
            self._slots.release()

    def status(self) -> CheckerStatus:
        with self._cond:
            if not self._restarting:
                return CheckerStatus("ok", self.start_failures)
            return CheckerStatus("restarting", self.start_failures, max(0.0, self._retry_at - time.monotonic()),
                                 self._error)

    def wait_ready(self, timeout: float) -> bool:
        """Until no restart is pending (False when `timeout` passes first)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._restarting, timeout)

    def close(self) -> None:
        """Stop the workers and the restarter (tests; at exit the workers see their input close)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            restarter = self._restarter
            self._cond.notify_all()
        for w in idle:
            w.kill()
        if restarter is not None:
            restarter.join(self.start_timeout + 5)

    # ---- workers ---------------------------------------------------------------------------
    def _take(self) -> _Worker:
        """An idle live worker, else a new one (CheckerUnavailable when it cannot start)."""
        while True:
            with self._cond:
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                break
            if worker.alive():
                return worker
            worker.kill()
        self._refuse_while_restarting()  # a restart may have begun while this waited for its slot
        try:
            return _Worker(self.command, self.start_timeout)
        except Exception as e:  # OSError mostly (EMFILE, EAGAIN, ENOENT, no ready line); whatever it is, retry
            self._start_failed(e)
            raise CheckerUnavailable("the grammar checker process did not start; retry shortly.",
                                     self.backoff[0] + 1.0) from None

    def _refuse_while_restarting(self) -> None:
        with self._cond:
            if not self._restarting:
                return
            left = self._retry_at - time.monotonic()
            if self._restarter is None and not self._closed:  # its thread could not start: try again now
                self._start_restarter_locked()
        # The cause (a path, an errno) is for the log and checker_status, not for callers.
        raise CheckerUnavailable("the grammar checker process is restarting; retry shortly.", left + 1.0)

    def _start_failed(self, e: BaseException) -> None:
        log.warning("the grammar checker process did not start (%s: %s); grammar requests are refused with 503 "
                    "until it does", type(e).__name__, e)
        with self._cond:
            self.start_failures += 1
            self._error = f"{type(e).__name__}: {e}"
            if self._restarting:
                return
            self._restarting, self._streak = True, 1
            self._retry_at = time.monotonic() + self.backoff[0]
            self._start_restarter_locked()

    def _start_restarter_locked(self) -> None:
        try:
            t = threading.Thread(target=self._restart_loop, name="tokenmill-grammar-restart", daemon=True)
            t.start()
        except RuntimeError:  # no thread either: the next check tries to start one again
            return
        self._restarter = t

    def _restart_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (left := self._retry_at - time.monotonic()) > 0:
                    self._cond.wait(left)
                if self._closed:
                    self._restarter = None
                    return
            try:
                worker = _Worker(self.command, self.start_timeout)
            except Exception as e:
                with self._cond:
                    self.start_failures += 1
                    self._error = f"{type(e).__name__}: {e}"
                    wait = min(self.backoff[1], self.backoff[0] * 2 ** self._streak)
                    self._streak += 1
                    self._retry_at = time.monotonic() + wait
                    self._cond.notify_all()  # status readers
                log.warning("the grammar checker process did not start again (%s: %s); next try in %.0f s",
                            type(e).__name__, e, wait)
                continue
            with self._cond:
                self._idle.append(worker)
                failed, self._streak = self._streak, 0
                self._restarting, self._restarter, self._error = False, None, None
                self._cond.notify_all()
            log.info("the grammar checker process started after %d failed start(s)", failed)
            return


_pool = CheckerPool()
_local_pool: StackPool | None = None


def check_isolated(grammar: str, timeout: float) -> str:
    """llguidance's check of `grammar` ("" valid, else the error), in a worker process (CheckerPool.check).
    Only where this platform has no worker support at all does it run on a thread here."""
    if IN_PROCESS:
        return _check_here(grammar, timeout)
    return _pool.check(grammar, timeout)


def checker_status() -> CheckerStatus:
    """The grammar checker's state, for /health and /metrics."""
    if IN_PROCESS:
        return CheckerStatus("in_process", 0)
    return _pool.status()


def _check_here(grammar: str, timeout: float) -> str:
    global _local_pool
    import llguidance

    if _local_pool is None:
        _local_pool = StackPool(CHECK_WORKERS, COMPILE_STACK_BYTES, "grammar-check")
    future = _local_pool.submit(llguidance.LLMatcher.validate_grammar, grammar)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        return f"it did not compile within {timeout:g} s."


def _worker_main() -> None:
    """The checker process's loop; exits when its input closes (the parent is gone)."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server; it closes our input
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = WORKER_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(hard, WORKER_MEMORY_BYTES)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):
        pass
    import llguidance

    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        grammar = json.loads(line)["grammar"]
        result: dict[str, str] = {}

        def run() -> None:
            try:
                result["error"] = llguidance.LLMatcher.validate_grammar(grammar)
            except Exception as e:
                result["error"] = f"{type(e).__name__}: {e}"

        start_thread(run, "check", CHECK_STACK_BYTES).join()
        out.write(json.dumps({"error": result.get("error", "the check failed")[:4000]}).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder holds grammar.py and manager.py: no module of ours shadows another
    _worker_main()
