"""The step contract's second half: every scheduled request advanced by what the step computed and accepted
(new tokens, rejected drafts rolled back, stop conditions). Mixed into Scheduler. No torch here."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.core.batch import ModelRunnerOutput
from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.testing import faults

if TYPE_CHECKING:
    from tokenmill.core.kv_cache import KVCacheManager
    from tokenmill.core.scheduler import SchedulerOutput
    from tokenmill.core.spec_stats import SpecDecodingStats


class StepUpdate:
    """Mixed into Scheduler; counts into its token counters and speculative-decoding stats."""

    kv: KVCacheManager
    max_model_len: int
    num_lookahead_tokens: int
    spec_stats: SpecDecodingStats
    prompt_tokens: int
    generation_tokens: int

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance every scheduled request by what the step computed and accepted: any number of new
        tokens per request. KV slots of rejected drafts are rolled back (their blocks freed); stop
        tokens, max_tokens and max_model_len finish requests and free their blocks. A request whose update
        fails (a grammar matcher that raises, a bug) ends alone with an error; the others carry on."""
        sampled = dict(zip(result.req_ids, result.sampled_token_ids))
        outputs: list[EngineCoreOutput] = []
        now = self.clock()
        for req, n in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue  # finished while the step ran (an abort)
            self.current = req
            try:
                faults.maybe_raise("update", [req.request_id])
                o = self._update_one(req, n, out.spec.get(req.request_id, ()), sampled.get(req.request_id, []),
                                     result, now)
            except Exception as e:
                o = self.fail_request(req, f"the request failed in the engine: {type(e).__name__}: {e}")
            if self.kv.has_windows and req.status == RequestStatus.RUNNING:
                self.kv.release_out_of_window(req)
            if o is not None:
                outputs.append(o)
        self.current = None
        self._continuing = self.has_unfinished()
        return outputs


    def _update_one(self, req: Request, n: int, spec, new: list[int], result: ModelRunnerOutput,
                    now: float) -> EngineCoreOutput | None:
        rid = req.request_id
        rejected = len(spec) - max(len(new) - 1, 0) if spec else 0
        if spec:
            self.spec_stats.record(len(spec), len(spec) - rejected)
        before = req.num_computed_tokens
        req.num_computed_tokens = before + n - rejected
        self.prompt_tokens += max(0, min(req.num_computed_tokens, req.num_prompt_tokens) - min(before, req.num_prompt_tokens))
        req.spec_token_ids, req.spec_parents = [], None
        if req.pooling is not None:  # an embedding request: done once its prompt is, with no token sampled
            return self._pooled(req, result, now) if req.num_computed_tokens >= req.num_prompt_tokens else None
        prompt_lps = result.prompt_logprobs.get(rid)
        if not new and prompt_lps is None:
            return None
        grammar_end = grammar_done = False  # grammar_done: it stopped the request, its last token is text
        if req.grammar is not None:
            new, grammar_end = self.structured.accept(req, new)
        accepted, status = self._append(req, new)
        if grammar_end and status is None:
            if req.grammar.error is not None:  # a token outside the grammar: never pass it off as "stop"
                status, req.stop_reason = RequestStatus.FINISHED_ABORTED, f"grammar error: {req.grammar.error}"
            else:  # the grammar is complete: only EOS could follow
                status, grammar_done = RequestStatus.FINISHED_STOPPED, True
        if rejected:
            self.kv.trim(req, req.num_tokens + self.num_lookahead_tokens)
            if req.sent is not None:  # the worker must replace its table's tail, not just extend it
                req.sent = (req.sent[0], min(req.sent[1], len(req.block_ids)))
        self.generation_tokens += len(accepted)
        if accepted and req.first_token_time is None:
            req.first_token_time = now
        if status is not None:
            self.finish_request(req, status)
        else:
            req.spec_token_ids = result.spec_token_ids.get(rid, [])
            req.spec_parents = result.spec_parents.get(rid)
        lps = result.logprobs.get(rid)
        return EngineCoreOutput(
            rid, accepted, lps[: len(accepted)] if lps is not None else None, prompt_lps,
            req.status.value if req.finished else None, req.stop_reason, max(req.num_cached_tokens, 0),
            req.first_scheduled_time, req.first_token_time, req.finished_time, grammar_done)

    def _pooled(self, req: Request, result: ModelRunnerOutput, now: float) -> EngineCoreOutput:
        """An embedding request whose last prompt chunk ran: it finishes with the pooled vector (its blocks freed)."""
        vector = result.pooled.get(req.request_id)
        if vector is None:  # (update_from_output fails the request alone)
            raise RuntimeError("the step computed its prompt but returned no pooled hidden state")
        req.first_token_time = now  # the vector is its first (and only) output
        self.finish_request(req, RequestStatus.FINISHED_STOPPED)
        return EngineCoreOutput(req.request_id, [], finish_reason=req.status.value,
                                num_cached_tokens=max(req.num_cached_tokens, 0),
                                first_scheduled_time=req.first_scheduled_time, first_token_time=req.first_token_time,
                                finished_time=req.finished_time, pooled=vector)

    def _append(self, req: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append tokens until one finishes the request. Stop strings are the output processor's job."""
        p = req.params
        for i, tok in enumerate(tokens):
            req.append_token(tok)
            status = None
            if req.num_output_tokens >= p.min_tokens:
                if not p.ignore_eos and tok in req.eos_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                elif tok in req.stop_token_ids:
                    status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
            if status is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                return tokens[: i + 1], status
        return tokens, None
