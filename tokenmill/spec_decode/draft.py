"""Runs a draft beside the target: a smaller model (draft_model, quantized_self) or a head over the
target's hidden states (EAGLE, EAGLE-3, MTP), with its own KV pool on the target's block tables.

The draft's KV for position p lives at p's slot, in a pool of the same number of blocks as the target's,
so prefix sharing, preemption and freeing need no bookkeeping of their own. Per step:

1. catch-up: one ragged forward over each request's positions the draft has not yet seen (a prompt
   chunk, or the accepted tokens of the last verification), which also yields the first draft;
2. k-1 single-token passes, each feeding back the draft just chosen.

A model draft reads token t_p at p. A head reads (t_{p+1}, the target's feature at p), so it can only
catch up on positions the target computed in this step; it always runs its catch-up (one layer: cheap)
and its own later positions (fed its own features) are recomputed next step from the target's.

Draft KV that is stale (positions a model draft skipped while speculation was off, whose blocks may be
shared through the prefix cache) only lowers acceptance: verification keeps output exact whatever the
draft proposes.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from types import SimpleNamespace

import numpy as np
import torch

from tokenmill.executor.forward_clock import ForwardClock
from tokenmill.executor.input_batch import pack_layout
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import kv_quant
from tokenmill.layers.attention_backends.base import AttentionBackend
from tokenmill.sample.argmax import row_argmax
from tokenmill.sample.draws import generator_uniforms, inverse_cdf
from tokenmill.sample.sampler import apply_top_k_top_p_min_p
from tokenmill.spec_decode.eagle_tree import TreeShape, grow_trees
from tokenmill.spec_decode.tree import tree_safe


@dataclass
class StepView:
    """What the target step computed, as the proposers need it (batch order)."""

    requests: list  # input_batch.CachedRequestState: token_ids are those known before this step
    starts: np.ndarray  # num_computed_tokens before the step
    lens: list[int]  # tokens scheduled (drafts included)
    row_starts: np.ndarray  # first packed row of each request
    accepted: list[list[int] | None]  # tokens emitted this step (None: a prompt chunk that sampled nothing)
    hidden: torch.Tensor | None = None  # [T, H] the target's final hidden states
    aux_hidden: torch.Tensor | None = None  # [T, n*H] EAGLE-3's layer features

    def length(self, i: int) -> int:
        """Tokens request i has now: those before the step and those it emitted."""
        return len(self.requests[i].token_ids) + len(self.accepted[i] or ())

    def source_row(self, i: int) -> int:
        """The packed row whose hidden state produced request i's last emitted token: its position is the
        sequence's length - 2, and the step's rows start at position starts[i] (accepted tree paths are moved
        into chain order first: DraftProposal._propose in executor/draft_proposal.py)."""
        return int(self.row_starts[i]) + self.length(i) - 2 - int(self.starts[i])

    def tokens(self, i: int, a: int, b: int) -> list[int]:
        """Tokens [a, b) of request i's sequence now, without copying the whole context."""
        base, got = self.requests[i].token_ids, self.accepted[i] or []
        n = len(base)
        return base[a:b] if b <= n else base[a:n] + got[max(a - n, 0) : b - n]


@dataclass
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None  # [k, V] the distribution each draft was drawn from; None: greedy (a point mass)
    parents: list[int] | None = None  # a tree (spec_decode/tree.py): each node's parent; None: a chain


class DraftRunner:
    def __init__(self, module: torch.nn.Module, backend: AttentionBackend, block_size: int, device: torch.device,
                 vocab_size: int, max_model_len: int, head: bool) -> None:
        self.module = module
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.head = head  # reads (t_{p+1}, feature_p); else a model reading t_p
        self.attn_layers = [m for m in module.modules() if isinstance(m, Attention)]
        self.computed: dict[str, int] = {}  # request -> positions below this hold valid draft KV
        self.stale: set[int] = set()  # blocks whose draft KV positions were skipped
        # A model draft's KV of its own drafts: request -> (first position fed, drafts fed). Those accepted
        # next step are already in the cache, so catch-up starts after them.
        self.fed: dict[str, tuple[int, int]] = {}
        # (tokens, seconds) of each forward of the last propose, its logits and sampling included: the
        # catch-up first, then the single-token passes (the adaptive policy's draft costs).
        self.timings: list[tuple[int, float]] = []
        self.tree: TreeShape | None = None  # a head drafting EAGLE-2 trees (set by its proposer), else chains

    @property
    def shape(self) -> str:
        """What its k means to the adaptive policy (adaptive.py)."""
        return "tree" if self.tree is not None else "chain"

    # ---- KV pool --------------------------------------------------------------------------
    def block_bytes(self, kv_dtype: torch.dtype) -> int:
        return sum(kv_quant.layer_block_bytes(a, self.block_size, kv_dtype) for a in self.attn_layers)

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        self.backend.allocate_kv_cache(self.attn_layers, num_blocks, kv_dtype)

    def kv_caches(self) -> list[torch.Tensor]:
        return [t for a in self.attn_layers for t in kv_quant.layer_caches(a)]

    def forget(self, req_id: str) -> None:
        self.computed.pop(req_id, None)
        self.fed.pop(req_id, None)

    # ---- one step -------------------------------------------------------------------------
    def _segments(self, view: StepView, want: set[int], catch_up_all: bool):
        """Per request to run: (index, first position, tokens to feed, feature rows or None)."""
        bs = self.block_size
        segs = []
        for i, r in enumerate(view.requests):
            got = view.accepted[i]
            if not (catch_up_all or (i in want and got)):
                self._mark_stale(r, view, i)
                continue
            c, n = int(view.starts[i]), view.lens[i]
            dc = self.computed.get(r.req_id)
            if dc is None:  # new to the draft (or resumed): trust cached blocks unless marked stale
                dc = c
                for j, b in enumerate(r.block_ids[: c // bs]):
                    if b in self.stale:
                        dc = j * bs
                        break
            length = view.length(i)
            cap = len(r.block_ids) * bs  # positions with a slot
            if self.head:
                end = min(length - 1 if got else c + n, cap)  # the target's feature exists below end
                first = max(dc, c)  # features before c are gone with earlier steps
                if first >= end:
                    continue
                tokens = view.tokens(i, first + 1, end + 1)
                rows = int(view.row_starts[i]) + np.arange(first - c, end - c)
            else:
                fed = self.fed.pop(r.req_id, None)
                if fed is not None and got and dc == fed[0]:
                    dc += min(len(got) - 1, fed[1])  # accepted drafts' KV was written when they were fed
                end = min(length if got else c + n, cap)
                first = min(dc, end - 1) if got else dc
                if first >= end:
                    continue
                tokens = view.tokens(i, first, end)
                rows = None
            segs.append((i, first, tokens, rows))
        return segs

    def _mark_stale(self, r, view: StepView, i: int) -> None:
        dc = self.computed.get(r.req_id)
        if dc is None:
            dc = int(view.starts[i])
        bs = self.block_size
        end = int(view.starts[i]) + view.lens[i]
        self.stale.update(r.block_ids[dc // bs : -(-end // bs)])

    def _forward(self, input_ids: torch.Tensor, tables, first: np.ndarray, q_len: np.ndarray, features,
                 tree: tuple[np.ndarray, np.ndarray] | None = None):
        """One forward of the draft over q_len[i] tokens per request from position first[i]. tree: (each row's
        position, [R, N, N] visibility masks) for draft-tree nodes (spec_decode/eagle_tree.py): their slots still
        follow first[i], their rotary positions and attention come from the tree."""
        layout, positions = pack_layout(first, q_len, tables, self.block_size)
        if tree is not None:
            positions = tree[0]
            layout.tree_req = torch.arange(len(tables))
            layout.tree_mask = torch.from_numpy(tree[1])
        meta = self.backend.build_metadata(layout)
        pos = torch.from_numpy(positions).to(self.device)
        if self.head:
            return self.module(input_ids, pos, features, meta)
        return None, self.module(input_ids, pos, meta)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.module.compute_logits(hidden)
        V = self.vocab_size
        if logits.shape[-1] > V:
            logits = logits[:, :V]
        elif logits.shape[-1] < V:
            logits = torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))
        return logits

    def propose(self, view: StepView, want: set[int], k: int, catch_up_all: bool) -> dict[int, Draft]:
        """Catch up and draft up to k tokens for the requests `want` (indices into the batch) that sampled."""
        clock = ForwardClock(self.device)  # the catch-up and the first drafts (read once the drafts are copied)
        clock.start()
        self.timings = timings = []
        segs = self._segments(view, want, catch_up_all)
        if not segs:
            return {}
        reqs = view.requests
        first = np.fromiter((s[1] for s in segs), np.int64, len(segs))
        q_len = np.fromiter((len(s[2]) for s in segs), np.int64, len(segs))
        features = None
        if self.head:
            src = view.aux_hidden if self.module.aux_layers else view.hidden  # a DraftHead: EAGLE-3 reads aux states
            features = src[torch.from_numpy(np.concatenate([s[3] for s in segs]))]
        ids = torch.tensor(list(chain.from_iterable(s[2] for s in segs)), dtype=torch.long, device=self.device)
        feat, hidden = self._forward(ids,
                                     [reqs[s[0]].block_ids for s in segs], first, q_len, features)
        bs = self.block_size
        for (i, f, toks, _), n in zip(segs, q_len.tolist()):
            r = reqs[i]
            self.computed[r.req_id] = f + n
            if self.stale:
                self.stale.difference_update(r.block_ids[f // bs : (f + n) // bs])

        # Requests to draft for: those wanted that sampled, with room for at least one draft position.
        last_rows = np.cumsum(q_len) - 1
        active = []  # (segment index, request index, next position to feed, room)
        for j, (i, f, toks, _) in enumerate(segs):
            if i not in want or not view.accepted[i]:
                continue
            next_pos = f + len(toks)  # the position the first draft token is fed at (pass 2)
            room = min(len(reqs[i].block_ids) * bs, self.max_model_len) - next_pos
            active.append((j, i, next_pos, max(0, min(k - 1, room))))
        drafts: dict[int, Draft] = {}
        tree_shape = self.tree
        if tree_shape is not None and k > 1 and tree_shape.levels(k) >= 2:
            need = tree_shape.fed(k)
            grown = [a for a in active if a[3] >= need and tree_safe(reqs[a[1]], view.length(a[1]))]
            if grown:
                self._grow_trees(grown, last_rows, hidden, feat, reqs, k, drafts, clock, int(q_len.sum()))
                active = [a for a in active if a not in grown]
                clock = ForwardClock(self.device)  # (the chains' first drafts: not a forward, not timed)
                clock.start()
        if not active:
            if not drafts:
                clock.stop()
                timings.append((int(q_len.sum()), clock.seconds()))
            return drafts
        fed_of = list(active)
        rows = torch.from_numpy(last_rows[[a[0] for a in active]])
        out: dict[int, list[int]] = {a[1]: [] for a in active}
        probs: dict[int, list[torch.Tensor]] = {a[1]: [] for a in active}
        sampler = _DraftSampler([reqs[a[1]] for a in active], self.device)
        cur_hidden, cur_feat = hidden[rows], (feat[rows] if feat is not None else None)
        step = 0
        # tokens of the forward whose logits are sampled next (0: the catch-up was timed with the trees)
        fed_tokens = 0 if drafts else int(q_len.sum())
        passes, clocks = [], []  # per pass: (requests, drafts on the device), (tokens fed, its clock)
        while True:
            tokens, q = sampler.sample(self._logits(cur_hidden))
            clock.stop()
            clocks.append((fed_tokens, clock))
            passes.append(([a[1] for a in active], tokens))
            if q is not None:
                for row, (j, i, _, _) in enumerate(active):
                    if q[row] is not None:
                        probs[i].append(q[row])
            step += 1
            keep = [a for a in active if a[3] >= step]  # room for feeding this draft
            if step >= k or not keep:
                break
            sel = [active.index(a) for a in keep]
            sel_t = torch.tensor(sel, dtype=torch.long)
            first = np.fromiter((a[2] + step - 1 for a in keep), np.int64, len(keep))
            feats = cur_feat[sel_t] if cur_feat is not None else None
            sampler = sampler.subset(sel)
            clock = ForwardClock(self.device)
            clock.start()
            cur_feat, cur_hidden = self._forward(tokens[sel_t.to(tokens.device)], [reqs[a[1]].block_ids for a in keep],
                                                 first, np.ones(len(keep), np.int64), feats)
            fed_tokens = len(keep)
            active = keep
        # every pass's drafts reach the host in one copy (the passes fed them to the next on the device)
        host = torch.cat([t for _, t in passes]).cpu().tolist()
        at = 0
        for who, t in passes:
            for i, tok in zip(who, host[at : at + len(who)]):
                out[i].append(tok)
            at += len(who)
        timings.extend((n, c.seconds()) for n, c in clocks)
        if not self.head:
            for j, i, next_pos, room in fed_of:
                self.fed[reqs[i].req_id] = (next_pos, min(k - 1, room))
        drafts.update({i: Draft(toks, torch.stack(probs[i]) if probs[i] else None) for i, toks in out.items()})
        return drafts

    def _grow_trees(self, grown: list, last_rows: np.ndarray, hidden: torch.Tensor, feat: torch.Tensor | None,
                    reqs: list, k: int, drafts: dict[int, Draft], clock: ForwardClock, fed_tokens: int) -> None:
        """EAGLE-2 trees of k nodes for the requests `grown` (spec_decode/eagle_tree.py), into `drafts`. `clock`
        started with the catch-up forward of `fed_tokens` tokens; one timing per forward, that one included."""
        w = self.tree.width
        rows = torch.from_numpy(last_rows[[a[0] for a in grown]])
        first = np.fromiter((a[2] for a in grown), np.int64, len(grown))
        tables = [reqs[a[1]].block_ids for a in grown]
        R = len(grown)
        timed = [clock, fed_tokens]  # the forward being timed and its tokens

        def lap(next_tokens: int | None) -> None:
            """The timed forward ends; the next one (of next_tokens tokens) starts, unless None."""
            c, n = timed
            c.stop()
            self.timings.append((n, c.seconds()))
            if next_tokens is not None:
                timed[0] = ForwardClock(self.device)
                timed[0].start()
                timed[1] = next_tokens

        def level(ids: np.ndarray, depth: np.ndarray, masks: np.ndarray, feats: torch.Tensor | None):
            N = ids.shape[1]
            lap(R * N)
            out_feat, out_hidden = self._forward(
                torch.from_numpy(ids.reshape(-1)).to(self.device), tables, first, np.full(R, N, np.int64),
                feats.reshape(R * N, -1) if feats is not None else None,
                tree=((first[:, None] + depth - 1).reshape(-1), masks))
            logits = self._logits(out_hidden.view(R, N, -1)[:, -w:].reshape(R * w, -1))
            return (out_feat.view(R, N, -1) if out_feat is not None else None), logits

        trees = grow_trees(level, self._logits(hidden[rows]), feat[rows] if feat is not None else None, self.tree, k)
        for a, (tokens, parents) in zip(grown, trees):
            drafts[a[1]] = Draft(tokens, None, parents)
        lap(None)


class _DraftSampler:
    """Draws the drafts: greedy requests take the argmax (a point mass, no probabilities kept); the others
    sample from their temperature- and top-k/top-p/min-p-filtered draft distribution q, which the
    rejection sampler needs next step."""

    def __init__(self, requests: list, device: torch.device) -> None:
        self.requests = requests
        self.device = device
        params = [r.params for r in requests]
        self.greedy = [p.greedy for p in params]
        self.random = [i for i, g in enumerate(self.greedy) if not g]
        if self.random:
            ps = [params[i] for i in self.random]
            vec = lambda xs, dt: torch.tensor(xs, dtype=dt, device=device)  # noqa: E731
            self.temperature = vec([p.temperature for p in ps], torch.float32).unsqueeze(1)
            self.meta = SimpleNamespace(
                top_k=vec([p.top_k for p in ps], torch.long), top_p=vec([p.top_p for p in ps], torch.float32),
                min_p=vec([p.min_p for p in ps], torch.float32),
                use_top_k=any(p.top_k > 0 for p in ps), use_top_p=any(p.top_p < 1.0 for p in ps),
                use_min_p=any(p.min_p > 0.0 for p in ps))

    def subset(self, sel: list[int]) -> "_DraftSampler":
        return _DraftSampler([self.requests[i] for i in sel], self.device)

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None] | None]:
        tokens = row_argmax(logits)
        if not self.random:
            return tokens, None
        rows = torch.tensor(self.random, dtype=torch.long, device=logits.device)
        x = apply_top_k_top_p_min_p(logits[rows].float() / self.temperature, self.meta)
        q = x.softmax(dim=-1)
        gens = [self.requests[i].generator for i in self.random]
        drawn = inverse_cdf(q, generator_uniforms(gens, q.device))
        tokens[rows] = drawn
        per_row: list[torch.Tensor | None] = [None] * len(self.requests)
        for j, i in enumerate(self.random):
            per_row[i] = q[j]
        return tokens, per_row
