"""EngineCore: the scheduler and the executor, one step at a time. It runs in the caller's process
(`LLM`, or a thread of the server) or in a process of its own (core_proc.py). It sees token ids only:
tokenizing, detokenizing and stop strings belong to the processor and output processor."""
from __future__ import annotations

import logging
import time
from typing import Callable

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from tokenmill.core.batch import ModelRunnerOutput, ScheduledBatch
from tokenmill.core.kv_connector import ImportOp
from tokenmill.core.kv_offload import LoadOp, SaveOp, SpillOp
from tokenmill.core.request import EngineCoreRequest, RequestStatus
from tokenmill.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.stats import EngineStats, StepStats
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.testing import faults

log = logging.getLogger(__name__)

# A step with nothing to run but grammars compiling waits this long for one (the core loop's stall wait).
COMPILE_WAIT_S = 0.005


def _fatal(e: BaseException) -> bool:
    """A worker is gone: no step can run again (retrying one request at a time would not help)."""
    from tokenmill.executor.executor import WorkerDiedError

    return isinstance(e, WorkerDiedError)


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        """`tokenizer`: the caller's, when it shares this process (else loaded when a grammar first needs it)."""
        from tokenmill.executor.executor import Executor
        from tokenmill.executor.kv_transfer import build_tiers

        config.validate()
        self.config = config
        self.executor = Executor.create(config)
        info = self.info = self.executor.info
        offload = build_tiers(config.cache, info.offload, info.bytes_per_block)
        from tokenmill.core.kv_connector import make_connector

        # The workers' KV cache groups, each with its attention window (worker.kv_group_windows): blocks out of a
        # group's window are released as requests advance (vLLM's hybrid KV cache manager).
        self.kv = KVCacheManager(info.num_blocks, info.block_size, config.cache.enable_prefix_caching, offload,
                                 make_connector(config.kv_transfer), info.kv_group_windows)
        self._tokenizer = tokenizer
        self.structured = StructuredOutputManager(self._load_tokenizer, info.vocab_size, self._eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, self.kv, info.max_model_len, self.structured)
        self.stats = EngineStats()
        self._refused: list[EngineCoreOutput] = []  # requests refused when added, answered by the next step
        self._sent = False  # this step's batch reached the workers

    def _load_tokenizer(self):
        if self._tokenizer is None:
            from tokenmill.model.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.model.model, self.config.model.tokenizer)
        return self._tokenizer

    def _eos_token_ids(self) -> list[int]:
        from tokenmill.model.loader import eos_token_ids

        return sorted(eos_token_ids(self.config.model.model, self._load_tokenizer()))

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use.")
        request = req.to_request()
        try:
            self.scheduler.add_request(request)
        except ValueError as e:  # it could never run here (a prompt the whole KV pool cannot hold): a 400
            self._refused.append(EngineCoreOutput(req.request_id, [], finish_reason="abort", stop_reason=str(e),
                                                  error=str(e), error_status=400, finished_time=time.monotonic()))
            return
        if request.params.structured_outputs is not None:
            try:
                self.structured.add(request)
            except Exception as e:  # never let it run unconstrained
                log.exception("request %s: setting up its grammar failed", req.request_id)
                self._refused.append(self.scheduler.fail_request(
                    request, f"the structured output constraint could not be set up: {type(e).__name__}: {e}"))

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       stop_reason: int | str | None = None) -> None:
        self.scheduler.finish_requests(request_ids, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._refused)

    # ---- the step ------------------------------------------------------------------------
    # Every stage of a step attributes a failure to the request(s) it concerns and ends only those, with an
    # error in OpenAI's shape; queued requests are never touched, and a block is named in the prefix cache
    # only once its KV is written (kv.unwritten). Fault injection (tokenmill/testing/faults.py) raises at
    # each stage for a chosen request; tests/test_fault_injection.py runs them all under load.
    def step(self, on_scheduled: Callable[[SchedulerStats], None] | None = None) -> EngineCoreOutputs:
        """One step. `on_scheduled` hears the queue sizes as soon as the step is scheduled, before the
        forward pass (the server's admission control reads them)."""
        try:
            return self._step(on_scheduled)
        except Exception as e:
            if _fatal(e):
                raise
            # A bug in the isolation below: end the requests of this step, keep the queue.
            log.exception("engine step failed outside its stages; ending the running requests")
            self.kv.drop_unwritten_names()
            message = f"internal engine error: {type(e).__name__}: {e}"
            outputs = [self.scheduler.fail_request(r, message) for r in list(self.scheduler.running)]
            return EngineCoreOutputs(outputs, None, self.scheduler_stats(), self.stats.idle_s)

    def _step(self, on_scheduled: Callable[[SchedulerStats], None] | None) -> EngineCoreOutputs:
        st = StepStats()
        t0 = time.perf_counter()
        refused, self._refused = self._refused, []
        try:
            refused += self._fail_bad_grammars()
        except Exception:
            log.exception("polling grammar compiles failed; trying again next step")
        connector = self.kv.connector
        if connector is not None and connector.pending:  # handed-over KV read in the background: done yet?
            try:
                connector.mark_read(set(self.executor.collective_rpc("kv_prefetched", connector.pending_hashes())))
            except Exception as e:
                if _fatal(e):
                    raise
                log.exception("checking handed-over KV reads failed; trying again next step")
        out, failed = self._schedule()
        refused += failed + self.scheduler.take_ended()
        st.schedule_s = time.perf_counter() - t0
        if on_scheduled is not None:
            on_scheduled(self.scheduler_stats())
        self._transfer(out, st)
        if not out:
            if not refused and self.structured.num_compiling:
                self.structured.wait(COMPILE_WAIT_S)  # only grammars to wait for: do not spin
            elif not refused and connector is not None and connector.pending:
                time.sleep(COMPILE_WAIT_S / 5)  # only handed-over KV being read: do not spin
            self.stats.add(st)
            return EngineCoreOutputs(refused, None, self.scheduler_stats(), self.stats.idle_s)
        batch = None
        self._sent = False
        try:
            batch = self._build(out)
            t1 = time.perf_counter()
            self._fill_bitmask(batch, [r for r, _ in out.scheduled])
            st.grammar_s = time.perf_counter() - t1
            result = self._execute(batch)
            self.kv.names_written()
        except Exception as e:  # one request's failure must not fail the others: find it, run the rest
            if _fatal(e):
                raise
            log.warning("step of %d request(s) failed (%s: %s); running them one at a time", len(out.scheduled),
                        type(e).__name__, e)
            if batch is not None and not self._sent:
                self.scheduler.unbuild(batch)
            result, failed, batch = self._run_one_by_one(out, forget=self._sent)
            refused += failed
        exports = self.kv.take_export_ops()
        if exports:  # a KV producer: hand the blocks just computed to decode instances before replying
            try:
                connector.stats.seconds += self.executor.collective_rpc("export_kv", exports)
            except Exception as e:  # the decode side recomputes what it does not find
                if _fatal(e):
                    raise
                log.exception("handing %d KV block(s) over failed", len(exports))
        t1 = time.perf_counter()
        outputs = refused + self.scheduler.update_from_output(out, result)
        t = result.timings
        st.schedule_s += time.perf_counter() - t1
        st.prepare_s, st.forward_s, st.sample_s = t.prepare_s, t.forward_s, t.sample_s
        st.kv_tokens, st.attn_pairs = t.kv_tokens, t.attn_pairs
        st.attn_s, st.attn_bytes, st.collective_s = t.attn_s, t.attn_bytes, t.collective_s
        st.weight_wait_s = t.weight_wait_s
        st.num_tokens = batch.num_tokens if batch is not None else 0
        st.num_requests = len(out.scheduled)
        st.num_sampled = sum(len(o.new_token_ids) for o in outputs)
        st.end_time = time.perf_counter()
        self.stats.prompt_tokens = self.scheduler.prompt_tokens
        self.stats.generation_tokens = self.scheduler.generation_tokens
        self.stats.add(st)
        return EngineCoreOutputs(outputs, st, self.scheduler_stats(), self.stats.idle_s)

    # ---- the stages, each with its fault-injection point ------------------------------------
    def _schedule(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """schedule(); if it raises, the request it was handling ends (with no one to blame: the running
        ones) and this step runs nothing. The scheduler has put the requests it admitted back in the queue;
        running ones keep their blocks; names given this step are dropped (nothing was written)."""
        try:
            return self.scheduler.schedule(), []
        except Exception as e:
            if _fatal(e):
                raise
            culprit, self.scheduler.current = self.scheduler.current, None
            self.kv.drop_unwritten_names()
            message = f"the request failed in the engine: {type(e).__name__}: {e}"
            if culprit is not None and not culprit.finished:
                log.warning("scheduling request %s failed (%s); ending it", culprit.request_id, message)
                return SchedulerOutput(), [self.scheduler.fail_request(culprit, message)]
            log.exception("scheduling failed with no request to blame; ending the running requests")
            return SchedulerOutput(), [self.scheduler.fail_request(r, message) for r in list(self.scheduler.running)]

    def _transfer(self, out: SchedulerOutput, st: StepStats) -> None:
        """Saves, spills and loads of the lower KV tiers (and handed-over KV) run before the forward reads
        or overwrites blocks. If the transfer fails, every load counts as failed (those requests recompute
        the blocks) and every save or spill as lost (those copies are forgotten)."""
        ops = self.kv.take_transfer_ops()
        if not ops:
            return
        connector = self.kv.connector
        try:
            if faults.enabled():
                faults.maybe_raise("transfer", self._transfer_parties(out, ops))
            failed, st.offload_s = self.executor.transfer_kv(ops)
            if connector is not None:
                connector.timed(ops, st.offload_s)
        except Exception as e:
            if _fatal(e):
                raise
            log.warning("KV transfer of %d op(s) failed (%s: %s); loads recompute, saves are dropped", len(ops),
                        type(e).__name__, e)
            failed = [op for op in ops if isinstance(op, (LoadOp, ImportOp))]
            if self.kv.offload is not None:
                for op in ops:
                    for h in (op.hashes if isinstance(op, SpillOp) else [op.hash] if isinstance(op, SaveOp) else []):
                        self.kv.offload.forget(h)
        if failed:
            self.scheduler.recompute_failed_loads(out, self.kv.loads_failed(failed))

    @staticmethod
    def _transfer_parties(out: SchedulerOutput, ops: list) -> list[str]:
        """Who a step's transfer concerns, for fault injection: the requests that load blocks, and `kv-tier`
        when it also saves or spills."""
        loaded = {op.block_id for op in ops if isinstance(op, (LoadOp, ImportOp))}
        concerned = [r.request_id for r, _ in out.scheduled if not loaded.isdisjoint(r.held_block_ids())]
        return concerned + (["kv-tier"] if len(loaded) < len(ops) else [])

    def _build(self, out: SchedulerOutput) -> ScheduledBatch:
        faults.maybe_raise("build_batch", (r.request_id for r, _ in out.scheduled))
        return self.scheduler.build_batch(out)

    def _fill_bitmask(self, batch: ScheduledBatch, reqs: list) -> None:
        faults.maybe_raise("bitmask", (r.request_id for r in reqs))
        self.structured.fill_bitmask(batch, reqs)

    def _execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        faults.maybe_raise("forward", batch.req_ids)
        self._sent = True  # from here the workers' copies of the requests may change
        return self.executor.execute_model(batch)

    def _run_one_by_one(self, out: SchedulerOutput, forget: bool) -> tuple[
            ModelRunnerOutput, list[EngineCoreOutput], ScheduledBatch | None]:
        """After a failed step: the workers forget the step's requests if the batch reached them (`forget`:
        their copies may be half-updated) and each runs again alone, in batch order (a request admitted this step may share blocks an earlier one
        computes), through every stage from the batch build on. Requests that fail alone finish with an
        error, their uncomputed blocks unnamed; requests sharing those blocks go back to the queue to
        recompute them. `out.scheduled` keeps the requests that ran; their results come back merged, as one
        step's would, with the last batch that ran (for the step's figures)."""
        sched, bs = self.scheduler, self.kv.block_size
        if forget:
            for req, _ in out.scheduled:
                sched.unsend(req)
        merged = ModelRunnerOutput()
        ran, failed, tainted = [], [], set()
        last = None
        for req, n in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue
            if not tainted.isdisjoint(req.held_block_ids()):  # reads KV a failed request was to write: recompute it later
                sched.preempt(req)
                continue
            if forget and req.pooling == "mean" and req.num_computed_tokens:
                sched.preempt(req)  # the workers dropped its sum over the chunks already run: it starts again
                continue
            one = SchedulerOutput([(req, n)], spec={k: v for k, v in out.spec.items() if k == req.request_id})
            batch = None
            try:
                batch = self._build(one)
                self._fill_bitmask(batch, [req])
                result = self._execute(batch)
            except Exception as e:
                if _fatal(e):
                    raise
                log.warning("request %s failed in the engine step: %s: %s", req.request_id, type(e).__name__, e)
                if batch is not None:
                    sched.unbuild(batch)
                sched.unsend(req)  # (finishing it below tells the workers to drop it)
                first = req.num_computed_tokens // bs
                tainted.update(b for table in req.tables for b in table[first:])
                self.kv.unname_from(req, first)
                failed.append(sched.fail_request(req, f"the request failed in the engine: {type(e).__name__}: {e}"))
                continue
            self.kv.names_written(list(req.held_block_ids()))
            ran.append((req, n))
            merged.merge(result)
            last = batch
        self.kv.drop_unwritten_names()  # blocks of requests that failed or went back to the queue
        out.scheduled = ran
        return merged, failed, last

    def _fail_bad_grammars(self) -> list[EngineCoreOutput]:
        """Requests whose grammar did not compile end here, with the reason as their stop_reason (the
        processor checks grammars first, so only what needs the tokenizer to fail gets this far)."""
        outputs = []
        for req in self.structured.poll():
            if req.finished:
                continue
            message = req.grammar.error
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="abort",
                                            stop_reason=f"grammar error: {message}", error=message,
                                            finished_time=req.finished_time))
        return outputs

    def scheduler_stats(self) -> SchedulerStats:
        kv, sched = self.kv, self.scheduler
        offload = None
        if kv.offload is not None:
            o = kv.offload.stats
            offload = {"saves": o.saves, "spills": o.spills, "host_loads": o.host_loads,
                       "disk_loads": o.disk_loads, "load_failures": o.load_failures}
        return SchedulerStats(sched.num_running, sched.num_waiting, kv.usage, kv.stats.queries, kv.stats.hits,
                              kv.stats.evictions, sched.num_preemptions, sched.prompt_tokens,
                              sched.generation_tokens, offload,
                              sched.spec_stats.as_dict() if self.config.speculative is not None else None,
                              self._kv_transfer_stats())

    def _kv_transfer_stats(self) -> dict | None:
        c = self.kv.connector
        if c is None:
            return None
        st = c.stats
        return {"bytes": (st.exported + st.imported) * self.info.bytes_per_block, "seconds": st.seconds,
                "exported_blocks": st.exported, "imported_blocks": st.imported, "import_failures": st.import_failures}

    # ---- utility calls (also reachable over IPC) ----------------------------------------
    def diagnostics(self, last_n: int | None = None) -> dict:
        from tokenmill.diagnostics import engine_diagnostics

        return engine_diagnostics(self, last_n)

    def kv_events(self, since: int = 0) -> dict:
        """Prefix-cache blocks stored/removed after event `since` (see core/kv_events.py), with the block size
        a router needs to hash prompts the same way."""
        out = self.kv.events.since(since, lambda: list(self.kv.cached))
        out["block_size"] = self.kv.block_size
        return out

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
