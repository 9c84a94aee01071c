"""host_upload.Uploader: pinned staging buffers reused in turn, one non-blocking copy per array, a buffer rewritten
only after its last copy has run. Pinning and CUDA events are stood in for (this machine has neither); the
staging logic is the one CUDA runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill import host_upload
from tokenmill.host_upload import RING, Uploader


class FakeEvent:
    def __init__(self, log: list) -> None:
        self.log = log
        self.recorded = 0

    def record(self) -> None:
        self.recorded += 1
        self.log.append(("record", id(self)))

    def synchronize(self) -> None:
        self.log.append(("wait", id(self)))


@pytest.fixture
def staged(monkeypatch):
    log, pinned = [], []

    def pinned_empty(nbytes):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        pinned.append(buf)
        return buf

    monkeypatch.setattr(host_upload, "_pinned_empty", pinned_empty)
    monkeypatch.setattr(host_upload, "_event", lambda: FakeEvent(log))
    return Uploader("cpu", staging=True), log, pinned


def test_on_the_cpu_the_array_is_handed_over_without_a_copy():
    a = np.arange(6, dtype=np.int64)
    t = Uploader("cpu").upload(a)
    assert t.data_ptr() == a.ctypes.data


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float32, np.bool_])
def test_values_shapes_and_dtypes_survive_staging(staged, dtype):
    up, _, _ = staged
    a = (np.arange(12).reshape(3, 4) % 3).astype(dtype)
    out = up.upload(a)
    assert out.dtype == torch.from_numpy(a).dtype and out.shape == (3, 4)
    assert np.array_equal(out.numpy(), a)
    assert np.array_equal(up.upload(a.T).numpy(), a.T)  # non-contiguous input
    assert up.upload(np.zeros(0, dtype=dtype)).numel() == 0


def test_buffers_are_pinned_once_reused_in_turn_and_waited_for_before_reuse(staged):
    up, log, pinned = staged
    outs = [up.upload(np.full(100, i, dtype=np.int64)) for i in range(3 * RING)]
    assert len(pinned) == RING  # one pinned buffer per ring slot, allocated once
    # Every result is its own device tensor: later uploads do not overwrite earlier steps' tensors.
    assert [int(o[0]) for o in outs] == list(range(3 * RING))
    waits = [e for kind, e in log if kind == "wait"]
    assert len(waits) == 2 * RING  # each reuse waited for that buffer's previous copy first
    # The wait precedes the rewrite: before upload RING + j, slot j's event was recorded and is waited on.
    first_record = [e for kind, e in log if kind == "record"][:RING]
    assert waits[:RING] == first_record


def test_a_larger_array_grows_its_buffer(staged):
    up, _, pinned = staged
    big = np.arange(host_upload.MIN_BYTES // 8 * 3, dtype=np.int64)
    assert np.array_equal(up.upload(big).numpy(), big)
    assert pinned[-1].numel() >= big.nbytes
