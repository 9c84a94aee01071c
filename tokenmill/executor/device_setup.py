"""The worker's device set-up: its device, and torch.distributed with the process groups its parallel layout
needs (tensor-parallel groups within a pipeline stage, tensor- and context-parallel groups across each other)."""
from __future__ import annotations

import os

import torch

from tokenmill.config import EngineConfig


def init_device(config: EngineConfig, device: torch.device, rank: int, world_size: int,
                distributed_init_method: str | None) -> tuple[torch.device, object | None]:
    """Set this rank's device up and join the process group. Returns (the device, with its index for CUDA; the
    gloo group for control messages, None: the default group is already gloo)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else rank
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    if distributed_init_method is None:
        return device, None
    import torch.distributed as dist

    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks share the machine's cores: two ranks of two threads each on two cores would make
        # every GEMM wait for a preempted thread.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=distributed_init_method, rank=rank, world_size=world_size)
    # Control messages (the step each rank runs, the KV pool size) travel over gloo on the CPU, as
    # vLLM's CPU group: on NCCL they would need device tensors and a device sync per step.
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    par = config.parallel
    tp, pp, cp = par.tensor_parallel_size, par.pipeline_parallel_size, par.context_parallel_size
    from tokenmill.layers import collectives

    if tp > 1 and pp > 1:  # each stage's tensor-parallel collectives stay within the stage
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == rank // tp:
                collectives.set_group(group)
    if tp > 1 and cp > 1:  # rank = tp_rank * cp + cp_rank: TP over equal cp_rank, CP over equal tp_rank
        for c in range(cp):  # every rank creates every group, in the same order
            group = dist.new_group([t * cp + c for t in range(tp)])
            if c == rank % cp:
                collectives.set_group(group)
        for t in range(tp):
            group = dist.new_group([t * cp + c for c in range(cp)])
            if t == rank // cp:
                collectives.set_cp_group(group)
    return device, cpu_group
