"""Executors run the workers: in this process (`uni`), one process per rank (`mp`), or Ray actors placed on
one node or a cluster (`ray`, ray_executor.py).

The multiprocess executor sends each call to rank 0 over a pipe; rank 0 broadcasts it to the other ranks
with torch.distributed (gloo on CPU, NCCL's side channel on CUDA via the object broadcast), every rank
runs it, and rank 0 sends the result back. A worker that dies fails the call with WorkerDiedError,
never a hang.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import socket
import time
import traceback
import weakref
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.batch import ModelRunnerOutput, ScheduledBatch
from tokenmill.executor.worker import Worker, WorkerInfo

log = logging.getLogger(__name__)

# Seconds to wait for a worker to load its model and report ready.
WORKER_START_TIMEOUT_S = 600.0


class WorkerDiedError(RuntimeError):
    pass


class Executor:
    info: WorkerInfo

    @staticmethod
    def create(config: EngineConfig) -> "Executor":
        par = config.parallel
        world = par.world_size  # tensor x pipeline x decode-context-parallel ranks
        backend = par.distributed_executor_backend or ("uni" if world == 1 else "mp")
        if world > 1 and backend == "uni":
            raise ValueError(f"{world} ranks need one process each: distributed_executor_backend 'mp' or 'ray'.")
        if backend == "uni":
            return UniProcExecutor(config)
        if backend == "mp":
            return MultiprocExecutor(config, world)
        if backend == "ray":
            from tokenmill.executor.ray_executor import RayExecutor

            return RayExecutor(config, world)
        raise ValueError(f"distributed_executor_backend must be 'uni' or 'mp', got {backend!r}.")

    def execute_model(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", batch)

    def transfer_kv(self, ops: list) -> tuple[list, float]:
        return self.collective_rpc("transfer_kv", ops)

    def collective_rpc(self, method: str, *args) -> Any:
        raise NotImplementedError

    def check_health(self) -> None:
        self.collective_rpc("ping")

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.info = self.worker.init()

    def collective_rpc(self, method: str, *args) -> Any:
        return getattr(self.worker, method)(*args)  # RPC: a Worker method by name

    def shutdown(self) -> None:
        self.worker.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, world_size: int = 1) -> None:
        ctx = mp.get_context("spawn")  # fork after torch has started threads is unsafe
        self.config = config
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(config, rank, world_size, init_method, child),
                            name=f"tokenmill-worker-{rank}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        # Workers wait on their pipe; multiprocessing's exit hook joins them. Shut them down first when this
        # executor is collected or the interpreter exits (a finalizer's exit hook runs before
        # multiprocessing's), so a script that never calls shutdown() still exits (issue 25).
        self._finalizer = weakref.finalize(self, _shutdown_workers, self.conns, self.procs)
        try:
            infos = [self._recv(c, p, WORKER_START_TIMEOUT_S) for c, p in zip(self.conns, self.procs)]
        except BaseException:
            self.shutdown()
            raise
        self.info = infos[0]

    def _recv(self, conn, proc, timeout: float | None = None) -> Any:
        waited = 0.0
        while not conn.poll(0.1):
            waited += 0.1
            # Any rank: a dead peer leaves rank 0 waiting in a collective that never completes.
            if any(not p.is_alive() for p in self.procs):
                raise self._died()
            if timeout is not None and waited >= timeout:
                raise WorkerDiedError(f"worker process {proc.name} did not answer in {timeout:.0f} s.")
        try:
            status, value = conn.recv()
        except (EOFError, OSError):
            raise self._died(proc) from None
        if status == "error":
            exc, tb = value
            log.error("worker %s failed:\n%s", proc.name, tb)
            self._raise_if_a_worker_died(exc)
            raise exc
        return value

    def _raise_if_a_worker_died(self, exc: BaseException) -> None:
        """A collective that failed because a peer rank is gone (gloo: "Connection reset by peer") is the
        worker's death, not an error of this step: wait briefly for the process to be reaped, then say so."""
        for _ in range(20):
            if any(not p.is_alive() for p in self.procs):
                raise self._died() from exc
            if len(self.procs) == 1:
                return
            time.sleep(0.05)

    def _died(self, closed=None) -> WorkerDiedError:
        """The error for dead workers, naming every one that is gone. One rank's death takes its peers down
        with it (they fail in the next collective and exit), so the pipe that closed first need not be the
        rank that died first: wait briefly for the processes to be reaped and name them all."""
        deadline = time.monotonic() + 1.0
        while True:
            dead = [p for p in self.procs if not p.is_alive()]
            if (closed is None or closed in dead) and dead or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if not dead and closed is not None:
            dead = [closed]
        names = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead)
        return WorkerDiedError(f"worker process{'es' if len(dead) > 1 else ''} died: {names}.")

    def collective_rpc(self, method: str, *args) -> Any:
        try:
            self.conns[0].send((method, args))
        except (BrokenPipeError, OSError):
            raise self._died(self.procs[0]) from None
        r = reply_rank(self.config)  # the last pipeline stage has the step's result
        return self._recv(self.conns[r], self.procs[r])

    def check_health(self) -> None:
        if any(not p.is_alive() for p in self.procs):
            raise self._died()
        super().check_health()

    def shutdown(self) -> None:
        self._finalizer()  # runs _shutdown_workers once, whoever calls first


def _shutdown_workers(conns: list, procs: list) -> None:
    for c, p in zip(conns, procs):
        if p.is_alive():
            try:
                c.send(("shutdown", ()))
            except (BrokenPipeError, OSError):
                pass
    for p in procs:
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for c in conns:
        c.close()


def reply_rank(config: EngineConfig) -> int:
    """The rank that answers calls: the first rank of the last pipeline stage (rank 0 without pipelining)."""
    par = config.parallel
    return par.tensor_parallel_size * (par.pipeline_parallel_size - 1) * par.context_parallel_size


def worker_main(config: EngineConfig, rank: int, world_size: int, init_method: str, conn) -> None:
    """A worker process: report ready, then run calls until shutdown or until the parent goes away."""
    import torch.distributed as dist

    from tokenmill.platform import tune_malloc

    # Signals to the process group are the parent's to handle: it drains, then stops the workers (a worker
    # killed first would fail the requests in flight and leave its KV tier's folder behind).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tune_malloc()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s worker{rank} %(name)s: %(message)s")
    worker = Worker(config, rank, world_size, init_method)
    try:
        conn.send(("ok", worker.init()))
    except BaseException as e:
        conn.send(("error", (_picklable(e), traceback.format_exc())))
        return
    while True:
        if rank == 0:
            try:
                call = conn.recv()
            except (EOFError, OSError):  # the executor is gone
                call = ("shutdown", ())
        else:
            call = None
        if world_size > 1:
            box = [call]
            try:
                dist.broadcast_object_list(box, src=0, group=worker.cpu_group)
            except RuntimeError as e:  # a peer rank is gone: the executor reports the death, this rank exits
                log.error("worker %d: a peer rank is gone (%s); exiting", rank, e)
                break
            call = box[0]
        method, args = call
        if method == "shutdown":
            break
        try:
            reply = ("ok", getattr(worker, method)(*args))  # RPC: a Worker method by name
        except Exception as e:
            reply = ("error", (_picklable(e), traceback.format_exc()))
        if rank == reply_rank(config):
            try:
                conn.send(reply)
            except (BrokenPipeError, OSError):
                break
    worker.shutdown()


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
