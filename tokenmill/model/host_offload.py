"""Weights beyond device memory: `--cpu-offload-gb N` (vLLM's meaning) keeps N GiB of weights in host memory.

After loading, as few decoder layers as hold N GiB (spread evenly over the stack, as the disk stream picks them)
move to host memory, pinned on CUDA so that copies run asynchronously. Per step, for each offloaded layer in
forward order: its weights are copied to the device on a side stream (the next offloaded layer's copy is
launched when this one's forward starts, so the copy overlaps the layers between them), the layer's forward
waits on the copy's event (on the device: the host thread does not block), runs on the device copies, and its
hook then points the parameters back at the host tensors, so the device copies return to the caching allocator
(recorded on the compute stream: the memory is reused only once the forward's kernels are done). Device memory
holds the resident weights plus two offloaded layers; every step moves N GiB over the host link, which sets the
speed once that link is slower than the compute (/v1/diagnostics: `weights`, source "host").

Output is the resident model's: the same bytes run the same kernels. On the CPU the weights are in host memory
already (--weights-resident-gb streams from disk instead), so the engine refuses the flag there; this module
still runs with a CPU "device" (the copies are plain copies), which is how its choreography is tested here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.model.weight_store import choose_layers

log = logging.getLogger(__name__)


def _movable(p: torch.Tensor) -> bool:
    return not p.is_mkldnn and p.numel() > 0  # oneDNN-packed weights (CPU only) keep their opaque layout


@dataclass
class OffloadedLayer:
    index: int  # in the model's own layers
    params: list[nn.Parameter]
    host: list[torch.Tensor]  # the parameters' data in host memory (pinned on CUDA)
    nbytes: int


class HostOffload:
    """The offloaded layers of one model and their copies to the device. `HostOffload.attach(model, n, device)`."""

    def __init__(self, model: nn.Module, offload_bytes: int, device: torch.device) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        layers = list(model.own_layers)
        sizes = [sum(p.numel() * p.element_size() for p in layer.parameters() if _movable(p)) for layer in layers]
        self.total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        chosen = choose_layers(sizes, offload_bytes)
        self.streamed: list[OffloadedLayer] = []
        for i in chosen:
            params = [p for p in layers[i].parameters() if _movable(p)]
            host = []
            for p in params:
                h = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=cuda)
                h.copy_(p.data)
                host.append(h)
                p.data = h
            self.streamed.append(OffloadedLayer(i, params, host, sizes[i]))
        self.resident_bytes = self.total_bytes - self.streamed_bytes
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._pending: dict[int, tuple[list[torch.Tensor], object]] = {}  # k -> (device copies, copy-done event)
        if cuda:
            torch.cuda.empty_cache()  # the moved layers' device memory back to the driver, before the KV pool is sized
        self.read_bytes_per_s = self._measure_copy() if self.streamed else 0.0
        order = {s.index: k for k, s in enumerate(self.streamed)}
        for s in self.streamed:
            k = order[s.index]
            layers[s.index].register_forward_pre_hook(lambda mod, args, k=k: self._before(k))
            layers[s.index].register_forward_hook(lambda mod, args, out, k=k: self._after(k))

    @property
    def streamed_bytes(self) -> int:
        return sum(s.nbytes for s in self.streamed)

    def _measure_copy(self) -> float:
        """Bytes/s of host-to-device copies of the first offloaded layer (twice: the first warms up)."""
        for _ in range(2):
            t = time.perf_counter()
            copies, event = self._copy(0)
            if event is not None:
                event.synchronize()
            dt = time.perf_counter() - t
            del copies
        return self.streamed[0].nbytes / dt if dt > 0 else float("inf")

    def _copy(self, k: int) -> tuple[list[torch.Tensor], object]:
        """Launch layer k's copies to the device (on the side stream on CUDA); (device tensors, done event)."""
        s = self.streamed[k]
        if self._stream is None:
            return [h.to(self.device, copy=True) for h in s.host], None
        with torch.cuda.stream(self._stream):
            copies = [h.to(self.device, non_blocking=True) for h in s.host]
            event = torch.cuda.Event()
            event.record(self._stream)
        return copies, event

    def _before(self, k: int) -> None:
        copies, event = self._pending.pop(k, None) or self._copy(k)
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)  # the device waits for the copy, not this thread
            for c in copies:
                c.record_stream(compute)  # freed on the side stream's allocator only after the forward's kernels
        for p, c in zip(self.streamed[k].params, copies):
            p.data = c
        nxt = (k + 1) % len(self.streamed)  # the next offloaded layer (the first: next step's), copied meanwhile
        if nxt != k and nxt not in self._pending:
            self._pending[nxt] = self._copy(nxt)

    def _after(self, k: int) -> None:
        s = self.streamed[k]
        for p, h in zip(s.params, s.host):
            p.data = h

    def take_wait(self) -> float:
        """Host-side waits for copies: none (the device waits on each copy's event)."""
        return 0.0

    def describe(self) -> dict:
        return {"source": "host", "resident_bytes": self.resident_bytes, "streamed_bytes_per_step": self.streamed_bytes,
                "streamed_layers": [s.index for s in self.streamed], "total_bytes": self.total_bytes,
                "read_bytes_per_s": self.read_bytes_per_s}

    @classmethod
    def attach(cls, model: nn.Module, offload_bytes: int, device: torch.device) -> HostOffload:
        store = cls(model, offload_bytes, device)
        model.weight_store = store
        log.info("weights: %.1f MiB on %s, %.1f MiB of %d layer(s) in host memory copied in per step (at %.0f MiB/s: "
                 "%.1f ms per step at least)", store.resident_bytes / 2**20, store.device,
                 store.streamed_bytes / 2**20, len(store.streamed), store.read_bytes_per_s / 2**20,
                 1e3 * store.streamed_bytes / store.read_bytes_per_s if store.read_bytes_per_s else 0.0)
        return store
