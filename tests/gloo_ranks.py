"""Run a function on two (or more) gloo ranks in spawned processes, for tests of real collectives."""
from __future__ import annotations

import socket
from typing import Any, Callable

import torch


def _rank_main(fn: Callable, rank: int, world: int, port: int, args: tuple, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results[rank] = fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, *args: Any, world: int = 2, timeout: float = 120.0) -> dict[int, Any]:
    """fn(rank, *args) on every rank (a module-level function: spawn pickles it by name); their results."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        assert [p.exitcode for p in procs] == [0] * world
        return dict(results)
