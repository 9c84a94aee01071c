"""The model runner's tree verification: every request's drafts verified as a tree on the device, and the
accepted paths' K/V moved into chain order where the next step reads them. Mixed into ModelRunner."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.batch import ModelRunnerOutput
from tokenmill.executor.input_batch import InputBatch, StepInputs
from tokenmill.executor.kv_groups import KVGroup
from tokenmill.layers.attention_backends import kv_quant
from tokenmill.sample.sampler import Sampler, SamplingMetadata
from tokenmill.sample.tree_sampler import TreeDraft, verify_on_device
from tokenmill.spec_decode.tree import chain


class TreeVerification:
    """Mixed into ModelRunner; writes `_path_rows`, the packed rows moved (source, destination), which the
    draft proposal reads the same step."""

    input_batch: InputBatch
    kv_groups: list[KVGroup]
    _path_rows: tuple[torch.Tensor, torch.Tensor] | None

    def _verify_trees(self, inp: StepInputs, raw: torch.Tensor, greedy_ids: torch.Tensor, probs: torch.Tensor | None,
                      meta: SamplingMetadata) -> ModelRunnerOutput:
        """Verify every sampled request's drafts as a tree (point-mass drafts: tree proposers draft
        deterministically), move the accepted paths' K/V into place, and emit each path and one token more."""
        trees, batch_index, greedy = [], [], []
        row = 0
        for i, (r, rows, spec, parents) in enumerate(zip(inp.requests, inp.rows_per_request, inp.spec,
                                                         inp.spec_parents)):
            if not rows:
                continue
            trees.append(TreeDraft(row, spec, parents if parents is not None else chain(len(spec))))
            batch_index.append(i)
            greedy.append(r.params.greedy)
            row += rows
        tokens, on_path, walk = verify_on_device(probs, greedy_ids, trees, greedy, meta.seeds)
        # The paths come back with the tokens (one copy); their K/V moves after it, on the device.
        tokens_h, lp, path = Sampler.output(raw, tokens, meta).to_host(on_path)
        emit_rows = walk.emit_rows(np.asarray(path, dtype=bool))
        self._path_rows = self._compact_accepted_paths(inp, trees, batch_index, emit_rows)
        return self._emit(inp, tokens_h, lp, None, emit_rows)

    def _compact_accepted_paths(self, inp: StepInputs, trees: list[TreeDraft], batch_index: list[int],
                                emit_rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A tree's accepted nodes hold their K/V at their own slots (c + 1 + node); the path's must be at
        c + 1 .. c + a, where the next step reads them: copied there in every layer of every KV cache group
        (nothing to do where the path is nodes 0 .. a - 1, as a chain's always is). Returns the packed rows
        moved (source, destination), for the hidden states the proposers read the same way (None: none)."""
        lay = inp.layout
        q_end = (lay.query_start + lay.query_len).tolist()
        src, dst = [], []
        for t, i, rows in zip(trees, batch_index, emit_rows):
            path = [r - t.root_row - 1 for r in rows[1:]]
            if path == list(range(len(path))):
                continue
            first = q_end[i] - len(t.tokens)  # packed row of node 0
            src += [first + m for m in path]
            dst += [first + j for j in range(len(path))]
        if not src:
            return None
        src_rows, dst_rows = torch.tensor(src), torch.tensor(dst)
        upload = self.input_batch.uploader.upload
        for g, group in enumerate(self.kv_groups):
            slots = (lay if g == 0 else inp.group_layouts[g - 1]).slot_mapping
            s, d = upload(slots[src_rows]), upload(slots[dst_rows])
            for a in group.layers:
                for cache in kv_quant.layer_caches(a):
                    flat = cache.view(-1, *cache.shape[2:])
                    flat.index_copy_(0, d, flat.index_select(0, s))
        return src_rows, dst_rows
