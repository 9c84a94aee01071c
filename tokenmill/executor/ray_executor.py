"""`--distributed-executor-backend ray`: Ray places one worker actor per rank, on this node or across a
cluster; torch.distributed (gloo on CPU, NCCL on CUDA) still carries the tensors between ranks.

Ray only starts the actors and delivers each call to every rank (so no object broadcast is needed); rank 0's
result is the step's. The workers rendezvous at rank 0's node address. Joins a running cluster when
RAY_ADDRESS is set (or `ray start --head` ran on this machine), else starts a local instance. An actor that
dies fails the call with WorkerDiedError, never a hang.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.executor.executor import WORKER_START_TIMEOUT_S, Executor, WorkerDiedError, reply_rank
from tokenmill.executor.worker import Worker

log = logging.getLogger(__name__)


class RayWorker:
    """The actor: a Worker plus the two calls the executor needs before it has an address."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int) -> None:
        import torch

        from tokenmill.platform import tune_malloc

        tune_malloc()
        if config.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, int(os.environ.get("TOKENMILL_RAY_THREADS", "1"))))
        self.config, self.rank, self.world_size = config, rank, world_size
        self.worker: Worker | None = None

    def node_address(self) -> tuple[str, int]:
        import ray

        from tokenmill.executor.executor import _free_port

        return ray.util.get_node_ip_address(), _free_port()

    def init(self, init_method: str):
        self.worker = Worker(self.config, self.rank, self.world_size, init_method)
        return self.worker.init()

    def call(self, method: str, *args) -> Any:
        return getattr(self.worker, method)(*args)  # RPC: a Worker method by name


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, world_size: int) -> None:
        self.actors: list = []  # (first: shutdown() reads it, also when this __init__ fails early)
        try:
            import ray
        except ImportError:
            raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'ray>=2.40'") from None
        self.ray = ray
        self.config = config
        self.started_ray = False
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            try:
                ray.init(address=address or "auto", include_dashboard=False, log_to_driver=False)
            except ConnectionError:  # no cluster running: a local instance
                ray.init(include_dashboard=False, log_to_driver=False)
                self.started_ray = True
        gpus = 1 if config.device.startswith("cuda") else 0
        actor = ray.remote(num_cpus=1, num_gpus=gpus)(RayWorker)
        self.actors = [actor.options(name=None).remote(config, rank, world_size) for rank in range(world_size)]
        try:
            host, port = ray.get(self.actors[0].node_address.remote(), timeout=WORKER_START_TIMEOUT_S)
            init_method = f"tcp://{host}:{port}"
            infos = ray.get([a.init.remote(init_method) for a in self.actors], timeout=WORKER_START_TIMEOUT_S)
        except BaseException as e:
            self.shutdown()
            raise self._died(e) from e
        self.info = infos[0]

    def _died(self, e: BaseException) -> BaseException:
        from ray.exceptions import GetTimeoutError, RayActorError

        if isinstance(e, RayActorError):
            return WorkerDiedError(f"a Ray worker actor died: {e}")
        if isinstance(e, GetTimeoutError):
            return WorkerDiedError(f"Ray workers did not answer in time: {e}")
        return e

    def collective_rpc(self, method: str, *args) -> Any:
        """Every rank runs the call; the reply rank's (the last pipeline stage's first) result is returned. A dead actor (or a collective broken by
        one) raises WorkerDiedError."""
        ray = self.ray
        from ray.exceptions import RayActorError, RayTaskError

        refs = [a.call.remote(method, *args) for a in self.actors]
        pending, results, first_error = list(refs), {}, None
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ref = done[0]
            try:
                results[ref] = ray.get(ref)
            except RayActorError as e:
                raise WorkerDiedError(f"a Ray worker actor died: {e}") from None
            except RayTaskError as e:
                first_error = first_error or e
                # A peer's death shows up on the others as a broken collective: look for a dead actor.
                for other in pending:
                    try:
                        ray.get(other, timeout=5)
                    except RayActorError as dead:
                        raise WorkerDiedError(f"a Ray worker actor died: {dead}") from None
                    except Exception:
                        pass
                pending = []
        if first_error is not None:
            cause = first_error.as_instanceof_cause() if hasattr(first_error, "as_instanceof_cause") else first_error
            raise cause
        return results[refs[reply_rank(self.config)]]

    def check_health(self) -> None:
        try:
            self.ray.get([a.call.remote("ping") for a in self.actors], timeout=30)
        except Exception as e:
            raise self._died(e) from None

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self.ray.get(a.call.remote("shutdown"), timeout=5)
            except Exception:
                pass
            try:
                self.ray.kill(a)
            except Exception:
                pass
        self.actors = []
        if self.started_ray and self.ray.is_initialized():
            self.ray.shutdown()
