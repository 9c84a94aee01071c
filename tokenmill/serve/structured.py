"""Request fields -> one StructuredOutputsParams: OpenAI's `response_format`, vLLM's `structured_outputs` and
its older `guided_*` extras. At most one source may constrain a request; each bad value is a 400 naming
its field, and the grammar is checked (off the event loop) before the request reaches the engine."""
from __future__ import annotations

import asyncio
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.serve.errors import APIError, bad_request
from tokenmill.structured_output.checker import CheckerUnavailable


def _from_response_format(rf) -> StructuredOutputsParams | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request('response_format of type "json_schema" needs json_schema.schema.',
                              "response_format.json_schema")
        return StructuredOutputsParams(json=rf.json_schema.schema_)
    # vLLM's structural_tag response format
    if not rf.structures:
        raise bad_request('response_format of type "structural_tag" needs "structures".', "response_format")
    return StructuredOutputsParams(structural_tag={"structures": rf.structures, "triggers": rf.triggers or []})


def _from_structured_outputs(so) -> StructuredOutputsParams | None:
    if so is None:
        return None
    fields: dict[str, Any] = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                              "json_object": so.json_object, "structural_tag": so.structural_tag}
    if fields["json"] is True:  # vLLM accepts json: true for "any JSON object"
        fields["json"], fields["json_object"] = None, True
    return StructuredOutputsParams(**fields, disable_any_whitespace=so.disable_any_whitespace)


def _from_guided(req) -> list[tuple[str, StructuredOutputsParams]]:
    out = []
    if req.guided_json is not None:
        out.append(("guided_json", StructuredOutputsParams(json=req.guided_json)))
    if req.guided_regex is not None:
        out.append(("guided_regex", StructuredOutputsParams(regex=req.guided_regex)))
    if req.guided_choice is not None:
        out.append(("guided_choice", StructuredOutputsParams(choice=req.guided_choice)))
    if req.guided_grammar is not None:
        out.append(("guided_grammar", StructuredOutputsParams(grammar=req.guided_grammar)))
    return out


def request_constraint(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (None, None: unconstrained)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    for param, build in (("response_format", lambda: _from_response_format(req.response_format)),
                         ("structured_outputs", lambda: _from_structured_outputs(req.structured_outputs))):
        try:
            so = build()
        except ValueError as e:
            raise bad_request(" ".join(str(e).split()), param) from None
        if so is not None:
            found.append((param, so))
    try:
        found += _from_guided(req)
    except ValueError as e:
        raise bad_request(" ".join(str(e).split()), "guided_choice") from None
    if len(found) > 1:
        raise bad_request(f"only one structured output constraint may be given; got {', '.join(p for p, _ in found)}.",
                          found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


# Threads: one per checker process, plus one converting while both check. Waiting: a burst of distinct grammars.
CHECK_THREADS = 3
MAX_QUEUED_CHECKS = 64


class CheckLane:
    """Threads of their own for grammar checks: a check waits on a worker process (up to its timeout) and its
    GBNF conversion is Python, so neither holds the event loop nor the tokenizer's lane. At most `max_queued`
    checks wait or run at once; beyond that a request gets 503 (the queue has a bound)."""

    def __init__(self, threads: int = CHECK_THREADS, max_queued: int = MAX_QUEUED_CHECKS) -> None:
        self.threads, self.max_queued = threads, max_queued
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.queued = 0

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        with self._lock:
            if self.queued >= self.max_queued:
                raise CheckerUnavailable(f"{self.queued} grammar checks are already waiting.")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="tokenmill-grammar")
            self.queued += 1
            future = self._executor.submit(fn, *args)
        future.add_done_callback(self._done)  # counted until it ends, even if its caller went away
        return await asyncio.wrap_future(future)

    def _done(self, _future) -> None:
        with self._lock:
            self.queued -= 1


_lane = CheckLane()


async def check_constraint(state, so: StructuredOutputsParams, param: str) -> None:
    """Check the grammar off the event loop, once per distinct grammar (grammar.validate caches the verdict):
    its limits, then llguidance's compile check in a worker process (with a timeout). A bad one, or one over a
    limit, is a 400 naming the problem; no checker available right now is a 503 with Retry-After."""
    from tokenmill.structured_output.grammar import validate

    try:
        await _lane.run(validate, so)
    except ValueError as e:
        raise bad_request(" ".join(str(e).split()), param) from None
    except CheckerUnavailable as e:
        raise APIError(503, f"The grammar cannot be checked right now: {e}", param, "grammar_checker_unavailable",
                       headers={"Retry-After": str(math.ceil(e.retry_after_s))}) from None
