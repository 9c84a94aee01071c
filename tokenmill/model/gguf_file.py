"""A fast reader for the GGUF container: metadata and tensor locations; tensor data read on demand.

gguf.GGUFReader builds a numpy view for every element of every metadata array, which takes ~4 s
on a 49k-token vocabulary; here long arrays are skipped over (their bytes are left in the file)
so a warm start reads SmolLM2's header in a fraction of a second. Dequantization stays with the
`gguf` package.

Tensor bytes are read into memory of our own (`raw`), not handed out as views of a mapping of the file:
the loader keeps the copy (the parameters are private tensors, and fused or Q/K-unpermuted rows are copies
anyway), so a mapping would only add the file's pages to the process RSS for as long as something held the
reader (read_gguf caches it), doubling the weights' resident size.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

GGUF_MAGIC = 0x46554747  # "GGUF" little-endian
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_ARRAY_ITEMS = 1024  # longer arrays (vocabularies, merges) are skipped, not decoded


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    ggml_type: int
    offset: int  # from the start of the data section


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fields: dict[str, object] = {}
        self.tensors: list[TensorInfo] = []
        with open(path, "rb") as f:
            self._buf = f.read(1 << 20)
            self._file = f
            self._pos = 0
            self._parse()
            del self._file, self._buf
        self.size = os.path.getsize(path)

    # ---- low-level reads over a growing buffer -------------------------------------------
    def _need(self, n: int) -> None:
        while self._pos + n > len(self._buf):
            more = self._file.read(max(1 << 20, n))
            if not more:
                raise ValueError(f"{self.path}: truncated GGUF header")
            self._buf += more

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        self._need(size)
        v = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += size
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        self._need(n)
        s = self._buf[self._pos : self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _skip_strings(self, count: int) -> None:
        for _ in range(count):
            n = self._unpack("<Q")
            self._need(n)
            self._pos += n

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype = self._unpack("<I")
            count = self._unpack("<Q")
            if count > MAX_ARRAY_ITEMS:
                if itype == _STRING:
                    self._skip_strings(count)
                elif itype in _SCALARS:
                    size = struct.calcsize(_SCALARS[itype]) * count
                    self._need(size)
                    self._pos += size
                else:
                    raise ValueError(f"{self.path}: unsupported GGUF array item type {itype}")
                return None  # skipped
            return [self._value(itype) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")

    def _parse(self) -> None:
        if self._unpack("<I") != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file")
        version = self._unpack("<I")
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is too old")
        n_tensors = self._unpack("<Q")
        n_kv = self._unpack("<Q")
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            shape = tuple(self._unpack("<Q") for _ in range(n_dims))
            ggml_type = self._unpack("<I")
            offset = self._unpack("<Q")
            self.tensors.append(TensorInfo(name, shape, ggml_type, offset))
        align = int(self.fields.get("general.alignment", 32))
        self.data_offset = -(-self._pos // align) * align

    # ---- tensors -------------------------------------------------------------------------
    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes, as the `gguf` package's dequantize expects them (rows of blocks), in a new
        writable array (read from the file, not a view of a mapping).
        ValueError naming the tensor if its type is unknown, its rows are not whole blocks, or its bytes
        run past the next tensor or the end of the file (a truncated or corrupt file)."""
        import gguf

        try:
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"{self.path}: tensor {t.name} has unknown ggml type {t.ggml_type}") from None
        if not t.shape or t.shape[0] % block:
            raise ValueError(f"{self.path}: tensor {t.name} of type {qtype.name} has shape {t.shape}, whose first "
                             f"dimension is not a whole number of {block}-value blocks")
        n = int(np.prod(t.shape))
        nbytes = n // block * type_size
        start = self.data_offset + t.offset
        end = self._end_of(t)
        if start + nbytes > end:
            raise ValueError(f"{self.path}: tensor {t.name} ({qtype.name}, shape {t.shape}) needs {nbytes} bytes but "
                             f"only {max(end - start, 0)} are there before the next tensor or the end of the file "
                             f"(truncated or corrupt file)")
        row_bytes = t.shape[0] // block * type_size
        data = np.empty(nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(start)
            view, got = memoryview(data), 0
            while got < nbytes:  # readinto may return short counts
                n = f.readinto(view[got:])
                if not n:
                    raise ValueError(f"{self.path}: tensor {t.name} ends past the end of the file (truncated file)")
                got += n
        return data.reshape(-1, row_bytes)

    def _end_of(self, t: TensorInfo) -> int:
        """Where the tensor's bytes must end: the next tensor's start, or the end of the file."""
        if not hasattr(self, "_ends"):
            offsets = sorted({x.offset for x in self.tensors})
            nxt = dict(zip(offsets, offsets[1:]))
            self._ends = {x.name: self.data_offset + nxt[x.offset] if x.offset in nxt else self.size
                          for x in self.tensors}
        return self._ends[t.name]
