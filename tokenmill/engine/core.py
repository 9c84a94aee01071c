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
from tokenmill.core.batch import ModelRunnerOutput
from tokenmill.core.request import EngineCoreRequest, RequestStatus
from tokenmill.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.stats import EngineStats, StepStats
from tokenmill.structured_output.manager import StructuredOutputManager

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

        self.kv = KVCacheManager(info.num_blocks, info.block_size, config.cache.enable_prefix_caching, offload,
                                 make_connector(getattr(config, "kv_transfer", None)))
        self._tokenizer = tokenizer
        self.structured = StructuredOutputManager(self._load_tokenizer, info.vocab_size, self._eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, self.kv, info.max_model_len, self.structured)
        self.stats = EngineStats()

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
        if request.params.structured_outputs is not None:
            self.structured.add(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       stop_reason: int | str | None = None) -> None:
        self.scheduler.finish_requests(request_ids, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------
    def step(self, on_scheduled: Callable[[SchedulerStats], None] | None = None) -> EngineCoreOutputs:
        """One step. `on_scheduled` hears the queue sizes as soon as the step is scheduled, before the
        forward pass (the server's admission control reads them)."""
        st = StepStats()
        t0 = time.perf_counter()
        refused = self._fail_bad_grammars()
        connector = self.kv.connector
        if connector is not None and connector.pending:  # handed-over KV read in the background: done yet?
            connector.mark_read(set(self.executor.collective_rpc("kv_prefetched", connector.pending_hashes())))
        out = self.scheduler.schedule()
        st.schedule_s = time.perf_counter() - t0
        if on_scheduled is not None:
            on_scheduled(self.scheduler_stats())
        ops = self.kv.take_transfer_ops()
        if ops:
            # Saves, spills and loads of the lower KV tiers run before the forward reads or overwrites blocks.
            failed, st.offload_s = self.executor.transfer_kv(ops)
            if connector is not None:
                connector.timed(ops, st.offload_s)
            if failed:
                self.scheduler.recompute_failed_loads(out, self.kv.loads_failed(failed))
        if not out:
            if not refused and self.structured.num_compiling:
                self.structured.wait(COMPILE_WAIT_S)  # only grammars to wait for: do not spin
            elif not refused and connector is not None and connector.pending:
                time.sleep(COMPILE_WAIT_S / 5)  # only handed-over KV being read: do not spin
            self.stats.add(st)
            return EngineCoreOutputs(refused, None, self.scheduler_stats(), self.stats.idle_s)
        batch = self.scheduler.build_batch(out)
        t1 = time.perf_counter()
        self.structured.fill_bitmask(batch, [r for r, _ in out.scheduled])
        st.grammar_s = time.perf_counter() - t1
        try:
            result = self.executor.execute_model(batch)
        except Exception as e:  # one request's failure must not fail the others: find it, run the rest
            if _fatal(e):
                raise
            log.warning("step of %d request(s) failed (%s: %s); running them one at a time", len(out.scheduled),
                        type(e).__name__, e)
            result, failed = self._run_one_by_one(out)
            refused += failed
        exports = self.kv.take_export_ops()
        if exports:  # a KV producer: hand the blocks just computed to decode instances before replying
            connector.stats.seconds += self.executor.collective_rpc("export_kv", exports)
        t1 = time.perf_counter()
        outputs = refused + self.scheduler.update_from_output(out, result)
        t = result.timings
        st.schedule_s += time.perf_counter() - t1
        st.prepare_s, st.forward_s, st.sample_s = t.prepare_s, t.forward_s, t.sample_s
        st.kv_tokens, st.attn_pairs = t.kv_tokens, t.attn_pairs
        st.attn_s, st.attn_bytes, st.collective_s = t.attn_s, t.attn_bytes, t.collective_s
        st.num_tokens = batch.num_tokens
        st.num_requests = len(batch)
        st.num_sampled = sum(len(o.new_token_ids) for o in outputs)
        st.end_time = time.perf_counter()
        self.stats.prompt_tokens = self.scheduler.prompt_tokens
        self.stats.generation_tokens = self.scheduler.generation_tokens
        self.stats.add(st)
        return EngineCoreOutputs(outputs, st, self.scheduler_stats(), self.stats.idle_s)

    def _run_one_by_one(self, out: SchedulerOutput) -> tuple[ModelRunnerOutput, list[EngineCoreOutput]]:
        """After a failed step: the workers forget the step's requests (their copies may be half-updated) and
        run each again alone, in batch order (a request admitted this step may share blocks an earlier one
        computes). Requests that fail alone finish with an error, their uncomputed blocks unnamed; requests
        sharing those blocks go back to the queue to recompute them. `out.scheduled` keeps the requests that
        ran; their results come back merged, as one step's would."""
        sched, bs = self.scheduler, self.kv.block_size
        for req, _ in out.scheduled:
            sched.unsend(req)
        merged = ModelRunnerOutput()
        ran, failed, tainted = [], [], set()
        for req, n in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue
            if tainted & set(req.block_ids):  # reads KV a failed request was to write: recompute it later
                sched.preempt(req)
                continue
            one = SchedulerOutput([(req, n)], spec={k: v for k, v in out.spec.items() if k == req.request_id})
            batch = sched.build_batch(one)
            try:
                self.structured.fill_bitmask(batch, [req])
                result = self.executor.execute_model(batch)
            except Exception as e:
                if _fatal(e):
                    raise
                log.exception("request %s failed in the engine step", req.request_id)
                first = req.num_computed_tokens // bs
                tainted.update(req.block_ids[first:])
                self.kv.unname_from(req, first)
                sched.finish_request(req, RequestStatus.FINISHED_ABORTED)
                message = f"the request failed in the engine: {type(e).__name__}: {e}"
                failed.append(EngineCoreOutput(req.request_id, [], finish_reason="abort", stop_reason=message,
                                               error=message, error_status=500, finished_time=req.finished_time))
                continue
            ran.append((req, n))
            merged.merge(result)
        out.scheduled = ran
        return merged, failed

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
