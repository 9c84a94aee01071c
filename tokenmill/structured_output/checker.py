"""Keeping grammars from taking a process down, in three layers, so that what one misses the next catches; this
module only re-exports their public names (the callers' one import):

1. limits.py: limits checked before llguidance sees a grammar (check_grammar_text, check_json_schema,
   check_regex), on both paths that make grammar text. Over one is a ValueError naming it.
2. isolation.py: the caller's llguidance check runs in a worker process (checker_worker.py, on an 8 MiB
   thread), killed when it dies or overruns its timeout (`check_isolated`, `CheckerPool`); a worker that
   cannot start is retried with backoff while grammar requests get 503 (`CheckerUnavailable`).
3. threads.py: the core compiles on threads with a 64 MiB stack (`StackPool`), 8x the worker's, so a
   grammar that passed the worker's check also compiles in the core.
"""
from tokenmill.structured_output.checker_worker import WORKER_MEMORY_BYTES
from tokenmill.structured_output.isolation import (CHECK_WORKERS, IN_PROCESS, RESTART_BACKOFF_S,
                                                   WORKER_START_TIMEOUT_S, CheckerPool, CheckerStatus,
                                                   CheckerUnavailable, check_isolated, checker_status)
from tokenmill.structured_output.limits import (JSON_REF_COST, MAX_GRAMMAR_DEPTH, MAX_GRAMMAR_NESTING,
                                                MAX_GRAMMAR_RULES, MAX_JSON_DEPTH, MAX_JSON_NESTING,
                                                MAX_JSON_PROPERTIES, MAX_REGEX_NESTING, check_grammar_text,
                                                check_json_schema, check_regex, longest_chain)
from tokenmill.structured_output.threads import CHECK_STACK_BYTES, COMPILE_STACK_BYTES, StackPool, start_thread

__all__ = [
    "CHECK_STACK_BYTES", "CHECK_WORKERS", "COMPILE_STACK_BYTES", "IN_PROCESS", "JSON_REF_COST", "MAX_GRAMMAR_DEPTH",
    "MAX_GRAMMAR_NESTING", "MAX_GRAMMAR_RULES", "MAX_JSON_DEPTH", "MAX_JSON_NESTING", "MAX_JSON_PROPERTIES",
    "MAX_REGEX_NESTING", "RESTART_BACKOFF_S", "WORKER_MEMORY_BYTES", "WORKER_START_TIMEOUT_S", "CheckerPool",
    "CheckerStatus", "CheckerUnavailable", "StackPool", "check_grammar_text", "check_isolated", "check_json_schema",
    "check_regex", "checker_status", "longest_chain", "start_thread",
]
