"""Weights beyond memory: at most N bytes of weights stay in RAM, the other layers stream from disk each step.

`--weights-resident-gb N` (CPU). After loading (weights fused, quantized, packed as the kernels read them),
the weights of some decoder layers are written to a stream file (`--weights-stream-dir`, default the system's
temporary folder; unlinked at once, so it goes when the process does) and their parameters become views of
a private memory map of it: the same bytes in the same layout, so the output is the resident model's, bit for
bit. Which layers: as few as keep the rest within N, spread evenly over the stack so that every streamed
layer follows resident ones whose compute hides its read.

Per step, a background thread reads the streamed layers from the file ahead of use, in forward order, one after
the other. A layer's read is queued as soon as the streamed layer two before it has run and been dropped, so the
reader goes from one read straight to the next with no hand-off between them, and only the layer running and the
one being read are in memory (before, each read was asked for when the layer before it started, and on a loaded
2-core machine waking the reader for every layer left the disk idle for part of each step). A read is `os.preadv`
of exactly the layer's range in 8 MiB reads, which fills the page cache at the disk's speed, then
`madvise(MADV_POPULATE_READ)` through ctypes, the GIL released, which maps those cached pages, so the forward takes
no page faults. Readahead past the range and read-around on faults are off, so a dropped neighbour is never read
back; the large reads come first because with read-around off `posix_fadvise(WILLNEED)` reads only the device's
readahead window and POPULATE_READ faulted the rest in one 4 KiB page at a time, ~10x below the disk's speed
(issue 50). A streamed layer's forward waits for its read if it is not done (the time counted as
`StepTimings.weight_wait_s`), and after its forward its pages are given back: unmapped from the process
(`madvise(MADV_DONTNEED)`) and dropped from the page cache (`posix_fadvise(POSIX_FADV_DONTNEED)`), so every step
reads the streamed bytes from the disk again and the weights' resident size stays at N plus the layer being read
ahead and the one running.

The start-up log and /v1/diagnostics give the bytes streamed per step, the disk's read speed measured on the
stream file, and which bound sets the step's speed: the streamed bytes at that speed against the forward's
compute time (docs/long_context.md). The native decoder stack (one C++ call for all layers) is off while
layers stream: each layer's forward must be seen.

bf16/fp16 weights that were packed for oneDNN (layers/quantization/onednn_pack.py: an opaque layout, which no
file can hold) are unpacked to their plain layout in the layers chosen to stream, the same values, so a bf16 model
streams as a float32 one does (before, every packed weight stayed resident and a bf16 model's budget was refused);
those layers' matmuls then go through F.linear, which reorders per call, a cost the layer's read hides. Parameters
that cannot be views of a file stay resident and count against N: non-contiguous tensors. The model is whole in
memory while it loads (writing the stream file happens after), so N bounds the running process, not the load's
peak.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import mmap
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tokenmill.model.mapped_pages import c_function, trim_heap

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_READ_CHUNK = 8 << 20  # bytes per preadv call of the read-ahead
_MADV_POPULATE_READ = 22  # Linux 5.14+: read a range in and map it (page tables filled: no faults when used)


def _streamable(p: torch.Tensor) -> bool:
    return p.device.type == "cpu" and not p.is_mkldnn and p.is_contiguous() and p.numel() > 0


def _stream_bytes(layer: nn.Module) -> int:
    """Bytes of a layer that can stream: its plain parameters and its oneDNN-packed ones (unpacked if it does)."""
    return sum(p.numel() * p.element_size() for p in layer.parameters() if _streamable(p) or p.is_mkldnn)


def _unpack(layer: nn.Module) -> None:
    """Every oneDNN-packed weight of `layer` back in its plain [N, K] layout (the same values: the packing is a
    reorder), a parameter with the packed one's attributes; dense_matmul then takes F.linear for it."""
    for module in layer.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_mkldnn:
                plain = nn.Parameter(p.data.to_dense().contiguous(), requires_grad=False)
                plain.__dict__.update(vars(p))  # the loader's attributes (input_dim, output_dim, ...)
                setattr(module, name, plain)


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def choose_layers(sizes: list[int], excess: int) -> list[int]:
    """As few layers as cover `excess` bytes, spread evenly over the stack (so that every streamed layer follows
    resident ones whose compute hides its read)."""
    if excess <= 0 or not sizes:
        return []
    n = len(sizes)
    for count in range(1, n + 1):
        picks = sorted({min(n - 1, int((i + 0.5) * n / count)) for i in range(count)})
        if sum(sizes[i] for i in picks) >= excess:
            return picks
    raise ValueError("the weights do not fit the budget even with every decoder layer moved out")


@dataclass
class StreamedLayer:
    index: int  # in the model's own layers
    offset: int  # in the stream file, page-aligned
    nbytes: int  # page-rounded length of its range
    # What it streams is what of the layer could (_streamable: diagnostics finds it); an OffloadedLayer
    # (model/host_offload.py) lists the parameters it moved instead.
    params: ClassVar[tuple] = ()


class WeightStore:
    """The streamed layers of one model, their file and the read-ahead. `WeightStore.attach(model, budget)`."""

    # Every byte of the stream file is read through this (fd, buffers, offset) -> bytes read: the measured read
    # speed and each step's read-ahead alike. Tests put a slowed reader here to stand in for a slow disk.
    preadv = staticmethod(os.preadv)

    def __init__(self, model: nn.Module, budget_bytes: int, directory: str | None = None) -> None:
        layers = list(model.own_layers)
        total = _param_bytes(model)
        sizes = [_stream_bytes(layer) for layer in layers]
        fixed = total - sum(sizes)  # embeddings, head, norms, and what cannot stream
        if fixed > budget_bytes:
            # In MiB, and the least value the flag accepts: in GiB at 3 digits the two often read the same.
            least = -(-(fixed + 1) * 10**4 // 2**30) / 10**4  # rounded up to 0.0001 GiB (about 0.1 MiB)
            raise ValueError(f"--weights-resident-gb {budget_bytes / 2**30:.4g} ({budget_bytes / 2**20:.2f} MiB): "
                             f"the weights outside the decoder layers (embeddings, head, unstreamable parts) alone "
                             f"take {fixed / 2**20:.2f} MiB; the least accepted value is --weights-resident-gb "
                             f"{least:g}.")
        self.streamed: list[StreamedLayer] = []
        self.total_bytes = total
        self.wait_s = 0.0  # waited for reads since the last take_wait()
        self.read_errors = 0  # read-aheads that failed (the forward then faulted the layer's pages in itself)
        chosen = choose_layers(sizes, total - budget_bytes)
        self.resident_bytes = total - sum(sizes[i] for i in chosen)
        self._file = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self.read_bytes_per_s = 0.0
        if not chosen:
            return
        self._write(layers, chosen, directory)
        self.read_bytes_per_s = self._measure_read()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenmill-weights")
        order = {s.index: k for k, s in enumerate(self.streamed)}
        for s in self.streamed:
            layer = layers[s.index]
            k = order[s.index]
            layer.register_forward_pre_hook(lambda mod, args, k=k: self._before(k))
            layer.register_forward_hook(lambda mod, args, out, k=k: self._after(k))
        self._drop_all()
        self._prefetch(0)
        if len(self.streamed) > 1:
            self._prefetch(1)

    @property
    def streamed_bytes(self) -> int:
        return sum(s.nbytes for s in self.streamed)

    def _write(self, layers: list[nn.Module], chosen: list[int], directory: str | None) -> None:
        """The chosen layers' parameters into the stream file, page-aligned per layer; then the parameters
        become views of a private mapping of it and their heap copies are freed."""
        fd, path = tempfile.mkstemp(prefix="tokenmill-weights-", suffix=".bin", dir=directory)
        os.unlink(path)  # the file lives as long as the descriptor and the mapping
        offset = 0
        layout = []
        for i in chosen:
            start = offset
            _unpack(layers[i])
            params = [p for p in layers[i].parameters() if _streamable(p)]
            places = []
            for p in params:
                data = p.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
                os.pwrite(fd, memoryview(data), offset)
                places.append(offset)
                offset += -(-data.nbytes // 64) * 64  # 64-byte aligned, as the kernels' loads like
            offset = -(-offset // _PAGE) * _PAGE
            layout.append((i, start, offset - start, params, places))
        os.ftruncate(fd, max(offset, _PAGE))
        os.fsync(fd)
        self._fd = fd
        self._map = mmap.mmap(fd, offset, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # Exactly a layer's range is ever read: no readahead past it (the device's window may be MiBs: it would
        # bring dropped neighbours back) and no read-around on faults; the read-ahead thread asks for each range.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._map.madvise(mmap.MADV_RANDOM)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._madvise = c_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
        for i, start, nbytes, params, places in layout:
            for p, at in zip(params, places):
                view = torch.frombuffer(self._map, dtype=p.dtype, count=p.numel(), offset=at).view(p.shape)
                p.data = view
            self.streamed.append(StreamedLayer(i, start, nbytes))
        trim_heap()

    def _measure_read(self) -> float:
        """Bytes/s of a cold read of the stream file (its page cache dropped first): the disk's speed as the
        steps will see it."""
        n = min(self.streamed_bytes, 256 << 20)
        os.posix_fadvise(self._fd, 0, n, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        self._read(0, n)
        dt = time.perf_counter() - t
        return n / dt if dt > 0 else float("inf")

    def _read(self, offset: int, nbytes: int) -> None:
        buf = bytearray(min(_READ_CHUNK, nbytes))
        view = memoryview(buf)
        end = offset + nbytes
        while offset < end:
            got = self.preadv(self._fd, [view[: min(len(buf), end - offset)]], offset)
            if got <= 0:
                break
            offset += got

    def _load(self, offset: int, nbytes: int) -> None:
        """Read a range in ahead of use, in large reads into the page cache, then map it where the kernel can
        (MADV_POPULATE_READ: no faults in the forward). Mapping first would read it page by page (read-around is
        off), an order of magnitude slower."""
        self._read(offset, nbytes)
        if self._madvise is None or self._madvise(self._base + offset, nbytes, _MADV_POPULATE_READ) == 0:
            return
        if ctypes.get_errno() not in (0, errno.EINVAL):
            log.debug("MADV_POPULATE_READ failed (errno %d): the forward maps the cached pages", ctypes.get_errno())
        self._madvise = None  # EINVAL: a kernel before 5.14; the page cache is filled, the forward maps it

    def _prefetch(self, k: int) -> None:
        s = self.streamed[k]
        with self._lock:
            if k not in self._pending:
                self._pending[k] = self._pool.submit(self._load, s.offset, s.nbytes)

    def _before(self, k: int) -> None:
        with self._lock:
            future = self._pending.pop(k, None)
        if future is not None:
            if not future.done():
                t = time.perf_counter()
                concurrent.futures.wait([future])
                self.wait_s += time.perf_counter() - t
            error = future.exception()
            if error is not None:  # the read-ahead is advice: the forward's page faults read what it did not
                self.read_errors += 1
                log.warning("reading streamed layer %d ahead failed (%s: %s); its pages are read as the forward "
                            "touches them", self.streamed[k].index, type(error).__name__, error)

    def _after(self, k: int) -> None:
        self._drop(k)
        # The streamed layer two ahead (the next step's once it wraps; this one itself when there are one or two)
        # joins the reader's queue: the next one is read or being read, and this one's pages are gone.
        self._prefetch((k + 2) % len(self.streamed))

    def _drop(self, k: int) -> None:
        s = self.streamed[k]
        self._map.madvise(mmap.MADV_DONTNEED, s.offset, s.nbytes)
        os.posix_fadvise(self._fd, s.offset, s.nbytes, os.POSIX_FADV_DONTNEED)

    def _drop_all(self) -> None:
        for k in range(len(self.streamed)):
            self._drop(k)

    def take_wait(self) -> float:
        """Seconds forwards waited for the read-ahead since the last call."""
        w, self.wait_s = self.wait_s, 0.0
        return w

    def describe(self) -> dict:
        return {"source": "disk", "resident_bytes": self.resident_bytes, "streamed_bytes_per_step": self.streamed_bytes,
                "streamed_layers": [s.index for s in self.streamed], "total_bytes": self.total_bytes,
                "read_bytes_per_s": self.read_bytes_per_s}

    @classmethod
    def attach(cls, model: nn.Module, budget_bytes: int, directory: str | None = None) -> WeightStore:
        store = cls(model, budget_bytes, directory)
        model.weight_store = store
        if store.streamed:
            d = store.describe()
            log.info("weights: %.1f MiB resident, %.1f MiB of %d layer(s) streamed from disk per step (read at "
                     "%.0f MiB/s: %.1f ms per step at least)", d["resident_bytes"] / 2**20,
                     d["streamed_bytes_per_step"] / 2**20, len(store.streamed), store.read_bytes_per_s / 2**20,
                     1e3 * store.streamed_bytes / store.read_bytes_per_s)
        else:
            log.info("weights: all %.1f MiB fit --weights-resident-gb; nothing streamed", store.total_bytes / 2**20)
        return store
