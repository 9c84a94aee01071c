"""The engine core's grammar state: compile each constrained request's grammar off the step loop, fill one
token bitmask per step for every constrained row of the batch, and advance each matcher by the tokens
the step accepted. Runs next to the scheduler; matchers never leave the core process.

- Compiling runs in a thread pool (llguidance drops the GIL while it builds a matcher); a request waits in
  the queue until its grammar is ready (`ready`), so a slow grammar never stalls anyone else's step. The
  grammar text is made there too (`to_grammar`: GBNF is converted in Python, and the limits of limits.py
  are checked, so nothing that could overflow the compile's stack reaches llguidance), and the threads have
  a 64 MiB stack (threads.COMPILE_STACK_BYTES), 8x that of the caller's check.
- Compiled grammars are cached by (kind, canonical text): a repeat costs one `deep_copy`. A compile whose
  requests were all aborted still lands in the cache.
- A matcher holds exactly the request's accepted output: preemption by recompute keeps the tokens, so it
  keeps the matcher; drafts are masked ahead and rolled back inside llguidance, never consumed.
- EOS is in the mask only where the grammar accepts; once the grammar can take nothing but EOS the request
  is finished (`accept` returns True), so min_tokens or ignore_eos cannot push it past the end.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from tokenmill.structured_output.grammar import to_grammar
from tokenmill.structured_output.threads import COMPILE_STACK_BYTES, StackPool

log = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled grammars kept (templates; each request works on a copy)
COMPILE_THREADS = 2


@dataclass(eq=False)
class RequestGrammar:
    """One sequence's constraint."""

    key: tuple[str, str]
    start_after: tuple[int, ...]  # constrain only after the output holds these tokens (end of reasoning)
    future: concurrent.futures.Future | None = None
    matcher: Any = None  # llguidance.LLMatcher once compiled
    error: str | None = None
    active: bool = False  # the constraint applies to the next token

    def __post_init__(self) -> None:
        self.active = not self.start_after


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_s: list[float] = field(default_factory=list)  # recent compile times (seconds)


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Callable[[], list[int]]) -> None:
        self._load_tokenizer = load_tokenizer
        self._eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self._lltok = None
        self._eos_set: frozenset[int] = frozenset()
        self._tok_lock = threading.Lock()
        self._pool: StackPool | None = None
        self._executor = None  # llguidance.LLExecutor: fills bitmask rows in parallel
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._compiling: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._pending: list = []  # requests whose grammar is compiling
        self.stats = GrammarStats()
        self._stats_lock = threading.Lock()
        # _cache, _compiling and _pending belong to the core loop's thread alone (add, poll, fill_bitmask); the
        # compile threads only return futures.

    # ---- compiling ------------------------------------------------------------------------
    def tokenizer(self):
        """llguidance's view of the vocabulary (built once, ~1 s for 50k tokens)."""
        with self._tok_lock:
            if self._lltok is None:
                import llguidance.hf

                eos = sorted(set(self._eos_token_ids()))
                self._lltok = llguidance.hf.from_tokenizer(self._load_tokenizer(), n_vocab=self.vocab_size,
                                                           eos_token=eos or None)
                self._eos_set = frozenset(self._lltok.eos_tokens)
            return self._lltok

    def _build(self, so) -> Any:
        """The compile thread's work: the grammar text (limits checked), then the matcher."""
        return self._compile(to_grammar(so))

    def _compile(self, grammar: str) -> Any:
        import time

        import llguidance

        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        with self._stats_lock:  # two compile threads finish at once
            self.stats.compile_s = (self.stats.compile_s + [time.perf_counter() - t0])[-1000:]
        return matcher

    def add(self, req) -> None:
        """Start compiling `req`'s grammar (or take it from the cache); sets `req.grammar`."""
        so = req.params.structured_outputs
        g = req.grammar = RequestGrammar(so.spec(), so.start_after_token_ids)
        template = self._cache.get(g.key)
        if template is not None:
            self._cache.move_to_end(g.key)
            self.stats.cache_hits += 1
            g.matcher = template.deep_copy()
            return
        future = self._compiling.get(g.key)
        if future is None:
            if self._pool is None:
                self._pool = StackPool(COMPILE_THREADS, COMPILE_STACK_BYTES, "grammar")
            future = self._compiling[g.key] = self._pool.submit(self._build, so)
            self.stats.compiles += 1
        g.future = future
        self._pending.append(req)

    def poll(self) -> list:
        """Finish the compiles that are done; returns the requests whose grammar failed (the core ends them)."""
        if not self._pending and not self._compiling:
            return []
        self._finish_compiles()
        failed, still = [], []
        for req in self._pending:
            g = req.grammar
            if g is None:
                continue  # freed while compiling
            if g.error is None and not g.future.done():
                still.append(req)
                continue
            if g.error is None:
                try:
                    template = g.future.result()
                except Exception as e:
                    g.error = f"the structured output constraint did not compile: {e}"
                else:
                    g.matcher = template.deep_copy()
                g.future = None
            if g.error is not None:
                failed.append(req)
        self._pending = still
        return failed

    def _finish_compiles(self) -> None:
        """Take every finished compile out of `_compiling` and cache it, whether or not a request still waits
        for it: a compile whose requests were all aborted would otherwise stay there (and uncached) forever."""
        for key, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[key]
            if future.cancelled() or future.exception() is not None:
                continue
            self._cache[key] = future.result()
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)

    @property
    def num_compiling(self) -> int:
        return len(self._pending)

    def wait(self, timeout: float) -> None:
        """Block until a pending compile finishes (or `timeout`): for a step with nothing else to run, so the
        loop does not spin against the compiling thread for the GIL."""
        futures = [r.grammar.future for r in self._pending if r.grammar is not None and r.grammar.future is not None]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    # ---- one step -------------------------------------------------------------------------
    def fill_bitmask(self, batch, requests: list) -> None:
        """Set batch.grammar_bitmask ([rows, ceil(V/32)] int32, bit set = allowed) and
        batch.structured_output_rows (req_id -> its first row; one row per sampled row of the request).
        `requests` are the batch's requests in batch order."""
        rows: list[tuple[Any, int, list[int]]] = []
        n = 0
        for req, count in zip(requests, batch.num_sample_rows):
            g = req.grammar
            if count == 0 or g is None or g.matcher is None:
                continue
            drafts = list(batch.spec_token_ids.get(req.request_id, ()))
            skip = 0  # rows sampled before the constraint starts (still unmasked: all bits set)
            if not g.active:
                # Drafts may complete the start marker: rows after it are masked from the grammar's start.
                after = _after(req.output_token_ids + drafts, len(drafts), g.start_after) if drafts else None
                if after is None:
                    continue
                skip = len(drafts) - len(after)
                drafts = after
            batch.structured_output_rows[req.request_id] = n
            rows.append((g.matcher, n + skip, drafts))
            n += count
        if not rows:
            return
        import llguidance
        import llguidance.numpy as lnp

        if self._executor is None:
            self._executor = llguidance.LLExecutor(COMPILE_THREADS)
        bitmask = lnp.allocate_token_bitmask(n, self.vocab_size)
        # llguidance refuses an empty draft list in the draft call, and a batch can mix requests with drafts and
        # without (a token budget cuts some requests' drafts to none): each kind through its own call, both
        # writing their own rows of the one bitmask.
        with_drafts = [row for row in rows if row[2]]
        if with_drafts:
            lnp.fill_next_token_bitmask_par_with_draft_tokens(self._executor, with_drafts, bitmask)
        without = [(m, i) for m, i, draft in rows if not draft]
        if without:
            lnp.fill_next_token_bitmask_par(self._executor, without, bitmask)
        batch.grammar_bitmask = bitmask

    def accept(self, req, new_tokens: list[int]) -> tuple[list[int], bool]:
        """Advance `req`'s matcher by the tokens the step accepted (before they join its output). Returns the
        tokens to keep and whether the grammar ended the request: complete (only EOS could follow; tokens past
        that point, e.g. an accepted draft's bonus EOS, are dropped) or broken."""
        g = req.grammar
        if g is None or g.matcher is None or not new_tokens:
            return new_tokens, False
        offset = 0
        if not g.active:
            prior = req.output_token_ids
            after = _after(prior + new_tokens, len(new_tokens), g.start_after)
            if after is None:
                return new_tokens, False
            g.active = True
            offset = len(new_tokens) - len(after)
        m = g.matcher
        for i in range(offset, len(new_tokens)):
            if m.is_stopped():
                return new_tokens[:i], True
            if not m.consume_token(new_tokens[i]):
                # Only a token outside the mask gets here (a bug, or a row sampled before the mask applied).
                g.error = m.get_error() or "a token outside the grammar was sampled."
                log.warning("request %s left its grammar: %.500s", req.request_id, g.error)
                return new_tokens[:i], True
        if m.is_stopped() and new_tokens[-1] not in self._eos_set:
            return new_tokens, True  # complete; an EOS token (if sampled) finishes the request by itself
        return new_tokens, False

    def free(self, req) -> None:
        req.grammar = None  # a pending compile finds it gone in poll()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _after(output: list[int], num_new: int, marker: tuple[int, ...]) -> list[int] | None:
    """The output tokens after the first `marker` that ends within the last `num_new` tokens; None if none."""
    m = len(marker)
    start = max(0, len(output) - num_new - m + 1)
    for i in range(start, len(output) - m + 1):
        if tuple(output[i : i + m]) == marker:
            return output[i + m :]
    return None


def unpack_bitmask_np(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[rows, W] int32 -> [rows, vocab_size] bool (tests and tools; the sampler does this in torch)."""
    bits = (bitmask[:, :, None] >> np.arange(32, dtype=np.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)
