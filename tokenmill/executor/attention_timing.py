"""Whether the model runner times the attention backend per step (StepTimings.attn_s), and with what."""
from __future__ import annotations

import os

import torch

from tokenmill.layers.attention import AttentionTimer

# Time the attention backend per step: on CPU by default (two perf_counter calls per layer); elsewhere
# only with TOKENMILL_TIME_ATTENTION=1, since on CUDA each timed call must synchronise the device. 0: never.
TIME_ATTENTION_ENV = "TOKENMILL_TIME_ATTENTION"


def _attention_timer(device: torch.device) -> AttentionTimer | None:
    flag = os.environ.get(TIME_ATTENTION_ENV, "").strip()
    if flag == "0" or (not flag and device.type != "cpu"):
        return None
    if device.type not in ("cpu", "cuda"):
        return None  # no device synchronisation to time its kernels with
    return AttentionTimer(sync=device.type == "cuda")
