"""The worker-diff protocol: what the workers hold of each request, and the picklable step that brings them up
to date (new requests in full, the others as diffs; finished ones to drop). No torch here."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.core.batch import CachedRequestData, NewRequestData, ScheduledBatch
from tokenmill.core.request import Request

if TYPE_CHECKING:
    from tokenmill.core.scheduler import SchedulerOutput


class WorkerDiffs:
    """Mixed into the Scheduler: `req.sent` is what the workers hold of a request (tokens, blocks; None: nothing),
    `_forget` the requests they hold and must drop at the next batch."""

    def __init__(self) -> None:
        self._forget: list[str] = []  # requests the worker holds and must drop at the next batch
        self._built: tuple = (None, [])  # the last batch built, and what the workers held of its requests before

    def unsend(self, req: Request) -> None:
        if req.sent is not None:
            self._forget.append(req.request_id)
            req.sent = None

    def build_batch(self, out: SchedulerOutput) -> ScheduledBatch:
        """The picklable step for the workers: new requests in full, the others as diffs."""
        b = ScheduledBatch(finished_req_ids=list(self._forget))
        self._built = (b, [(req, req.sent) for req, _ in out.scheduled])
        for req, n in out.scheduled:
            rid = req.request_id
            start = req.num_computed_tokens
            spec = out.spec.get(rid)
            b.req_ids.append(rid)
            b.num_scheduled_tokens.append(n)
            if spec:
                b.spec_token_ids[rid] = spec
                if req.spec_parents is not None:  # a tree: its first len(spec) nodes are still one
                    b.spec_parents[rid] = req.spec_parents[: len(spec)]
                b.num_sample_rows.append(len(spec) + 1)
            else:
                # (an embedding request samples nothing: the runner pools its hidden states instead)
                b.num_sample_rows.append(1 if start + n >= req.num_tokens and req.pooling is None else 0)
            if req.sent is None:
                tables = [self._table(req, g) for g in range(len(req.tables))]
                b.new_requests.append(NewRequestData(
                    rid, list(req.token_ids), req.num_prompt_tokens, tables[0], start, req.params,
                    req.seed, tuple(sorted(req.eos_token_ids)), req.lora, tables[1:]))
            else:
                ntok, nblk = req.sent
                b.cached_requests.append(CachedRequestData(
                    rid, req.token_ids[ntok:], req.block_ids[nblk:], start, len(req.block_ids),
                    [t[nblk:] for t in req.tables[1:]]))
            req.sent = (len(req.token_ids), len(req.block_ids))
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                b.prompt_logprob_ranges[rid] = (start, min(n, req.num_prompt_tokens - 1 - start))
        self._forget = []  # only once the batch is whole (a failed build keeps them for the next one)
        return b

    @staticmethod
    def _table(req: Request, group: int) -> list[int]:
        """A group's block table for a worker that has none: released entries (never read) name a block the
        request holds in that group, so every id is a real block with finite KV."""
        table, released = req.tables[group], req.num_released[group]
        if not released:
            return list(table)
        return [table[released]] * released + table[released:]

    def unbuild(self, batch: ScheduledBatch) -> None:
        """The last batch built did not reach the workers: what they hold of its requests is what it was
        before, and they may not have dropped its finished requests (tell them again: dropping one twice is
        harmless)."""
        built, sent = self._built
        if built is batch:
            for req, before in sent:
                req.sent = before
        self._forget = batch.finished_req_ids + self._forget
