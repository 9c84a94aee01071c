"""The worker's persistent input batch (executor/input_batch.py): its per-row arrays, written only from each
step's diffs, hold what the request lists hold, and the step's tensors equal those rebuilt from whole lists
(the runner's way before the arrays), through random sequences of admissions, prompt chunks, decodes with
drafts (accepted or rejected, blocks freed and replaced), finishes and preemptions, and pipeline
micro-batches; with KV cache groups, every group's table (here group g's block b is b + 1000 g)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.core.batch import CachedRequestData, NewRequestData, ScheduledBatch
from tokenmill.executor.input_batch import InputBatch, StepInputs
from tokenmill.executor.model_runner import micro_batches
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
VOCAB = 100


class Core:
    """Plays the scheduler's part (core/worker_diffs.py build_batch, scheduler.py update_from_output): each request's
    tokens, computed count and block table, sent in full once (again after a preemption), then as diffs."""

    def __init__(self, groups: int = 1) -> None:
        self.groups = groups
        self.reqs: dict[str, dict] = {}
        self.finished: list[str] = []
        self.next_block = 1
        self.next_id = 0

    def blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def admit(self, prompt: list[int], cached: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.reqs[rid] = dict(tokens=list(prompt), num_prompt=len(prompt), computed=cached, blocks=[], sent=None)

    def preempt(self, rid: str, tell: bool) -> None:
        r = self.reqs[rid]
        r.update(computed=0, blocks=[], sent=None)
        if tell:
            self.finished.append(rid)

    def finish(self, rid: str) -> None:
        del self.reqs[rid]
        self.finished.append(rid)

    def schedule(self, data) -> tuple[ScheduledBatch, dict]:
        """A step over a random subset of the requests: a prompt chunk, or a decode with 0-3 drafts."""
        b = ScheduledBatch(finished_req_ids=self.finished)
        self.finished = []
        plan = {}
        for rid, r in self.reqs.items():
            if not data.draw(st.booleans(), label=f"run {rid}"):
                continue
            L, c = len(r["tokens"]), r["computed"]
            if c < L - 1:  # prompt (or a preempted request's recompute) left
                n = data.draw(st.integers(1, L - c), label="chunk")
                spec, rows = [], int(c + n == L)
                if r["num_prompt"] > 1 and c < r["num_prompt"] - 1 and data.draw(st.booleans(), label="plp"):
                    b.prompt_logprob_ranges[rid] = (c, min(n, r["num_prompt"] - 1 - c))
            else:
                spec = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=3), label="drafts")
                n, rows = 1 + len(spec), 1 + len(spec)
                if spec:
                    b.spec_token_ids[rid] = spec
            need = -(-(c + n) // BLOCK)
            if len(r["blocks"]) < need:
                r["blocks"] += self.blocks(need - len(r["blocks"]))
            b.req_ids.append(rid)
            b.num_scheduled_tokens.append(n)
            b.num_sample_rows.append(rows)
            if r["sent"] is None:
                b.new_requests.append(NewRequestData(rid, list(r["tokens"]), r["num_prompt"], list(r["blocks"]), c,
                                                     SamplingParams(), None, group_block_ids=[
                                                         group_table(r["blocks"], g) for g in range(1, self.groups)]))
            else:
                ntok, nblk = r["sent"]
                b.cached_requests.append(CachedRequestData(rid, r["tokens"][ntok:], r["blocks"][nblk:], c,
                                                           len(r["blocks"]), [group_table(r["blocks"][nblk:], g)
                                                                              for g in range(1, self.groups)]))
            r["sent"] = (len(r["tokens"]), len(r["blocks"]))
            plan[rid] = (n, rows, spec)
        return b, plan

    def complete(self, plan: dict, data) -> None:
        """The step's results: a sampled token after each chunk that reached the end, accepted drafts plus
        one token after a decode; rejected drafts' blocks freed."""
        for rid, (n, rows, spec) in plan.items():
            r = self.reqs[rid]
            accepted = data.draw(st.integers(0, len(spec)), label="accepted") if spec else 0
            r["computed"] += n - (len(spec) - accepted)
            if rows:
                r["tokens"] += spec[:accepted] + [data.draw(st.integers(0, VOCAB - 1), label="token")]
            if len(spec) > accepted:
                keep = -(-len(r["tokens"]) // BLOCK)
                if len(r["blocks"]) > keep:
                    del r["blocks"][keep:]
                    r["sent"] = (r["sent"][0], min(r["sent"][1], keep))


def group_table(blocks: list[int], group: int) -> list[int]:
    return [b + 1000 * group for b in blocks]


def reference(core: Core, batch: ScheduledBatch, group: int = 0) -> dict:
    """The step's inputs rebuilt from the core's lists, as the runner built them before the arrays."""
    ids, pos, slots, rows, tables, prompt_rows = [], [], [], [], [], []
    q_start, q_len, kv_len = [], [], []
    for rid, n, s in zip(batch.req_ids, batch.num_scheduled_tokens, batch.num_sample_rows):
        r = core.reqs[rid]
        c, spec = r["computed"], batch.spec_token_ids.get(rid, [])
        start = len(ids)
        ids += r["tokens"][c : c + n - len(spec)] + spec
        p = list(range(c, c + n))
        pos += p
        blocks = group_table(r["blocks"], group)
        slots += [blocks[x // BLOCK] * BLOCK + x % BLOCK for x in p]
        rows += list(range(start + n - s, start + n))
        tables.append(blocks)
        q_start.append(start)
        q_len.append(n)
        kv_len.append(c + n)
        if rid in batch.prompt_logprob_ranges:
            first, m = batch.prompt_logprob_ranges[rid]
            prompt_rows.append((rid, start, m, first))
    table = np.zeros((len(tables), max(map(len, tables))), np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, sample_rows=rows, block_table=table.tolist(),
                query_start=q_start, query_len=q_len, kv_len=kv_len, prompt_rows=prompt_rows,
                kv_tokens=sum(kv_len), attn_pairs=sum(x + 1 for x in pos))


def check_inputs(inp: StepInputs, want: dict, batch: ScheduledBatch, core: Core | None = None) -> None:
    lay = inp.layout
    if core is not None:
        assert len(inp.group_layouts) == core.groups - 1
        for g, glay in enumerate(inp.group_layouts, 1):
            gwant = reference(core, batch, g)
            assert glay.block_table.tolist() == gwant["block_table"] and glay.slot_mapping.tolist() == gwant["slot_mapping"]
            assert glay.query_len is lay.query_len and glay.kv_len is lay.kv_len
    got = dict(input_ids=inp.input_ids.tolist(), positions=inp.positions.tolist(),
               slot_mapping=lay.slot_mapping.tolist(), sample_rows=inp.sample_rows.tolist(),
               block_table=lay.block_table.tolist(), query_start=lay.query_start.tolist(),
               query_len=lay.query_len.tolist(), kv_len=lay.kv_len.tolist(),
               prompt_rows=[(r.req_id, row, m, first) for r, row, m, first in inp.prompt_rows],
               kv_tokens=inp.kv_tokens, attn_pairs=inp.attn_pairs)
    assert got == want
    assert inp.input_ids.dtype == inp.positions.dtype == inp.sample_rows.dtype == lay.slot_mapping.dtype == torch.long
    assert lay.num_tokens == len(want["input_ids"])
    assert lay.max_query_len == max(want["query_len"]) and lay.max_kv_len == max(want["kv_len"])
    assert [r.req_id for r in inp.requests] == batch.req_ids
    assert inp.rows_per_request == batch.num_sample_rows
    assert inp.spec == [batch.spec_token_ids.get(rid, []) for rid in batch.req_ids]


def check_arrays(ib: InputBatch, core: Core) -> None:
    """Every held request's row equals its lists (and the core's), with zeros past its blocks; no two
    requests share a row."""
    held = {rid: r for rid, r in core.reqs.items() if r["sent"] is not None}
    assert set(held) <= set(ib.requests) <= set(core.reqs)  # a preemption not yet told: the worker still holds it
    rows = [s.row for s in ib.requests.values()]
    assert len(set(rows)) == len(rows)
    for rid, r in held.items():
        s = ib.requests[rid]
        row = s.row
        assert s.token_ids == r["tokens"][: r["sent"][0]]
        # Past sent[1]: blocks the core freed since (rejected drafts) and has not yet told the worker about.
        assert s.block_ids[: r["sent"][1]] == r["blocks"][: r["sent"][1]]
        n, nb = ib.num_tokens[row], ib.num_blocks[row]
        assert n == len(s.token_ids) and nb == len(s.block_ids)
        assert ib.token_ids[row, :n].tolist() == s.token_ids
        for g in range(ib.num_groups):
            assert ib.block_table[g, row, :nb].tolist() == group_table(s.block_ids, g)
        assert not ib.block_table[:, row, nb:].any()
        assert ib.num_computed[row] == s.num_computed_tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_arrays_and_step_inputs_match_lists(data):
    groups = data.draw(st.sampled_from([1, 1, 2, 3]), label="groups")
    core, ib = Core(groups), InputBatch(BLOCK, torch.device("cpu"), VOCAB, groups)
    for _ in range(data.draw(st.integers(1, 14), label="steps")):
        for _ in range(data.draw(st.integers(0, 3), label="admit")):
            prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), label="prompt")
            core.admit(prompt, data.draw(st.integers(0, len(prompt) - 1), label="cached"))
        for rid in list(core.reqs):
            event = data.draw(st.sampled_from(["run", "run", "run", "finish", "preempt", "resend"]), label="event")
            if event == "finish":
                core.finish(rid)
            elif event in ("preempt", "resend"):
                core.preempt(rid, tell=event == "preempt")
        batch, plan = core.schedule(data)
        ib.update(batch)
        if batch:
            want = reference(core, batch)
            check_inputs(ib.prepare(batch), want, batch, core)
            # Pipeline parallelism prepares each micro-batch in turn; the first's inputs must survive the second.
            parts = micro_batches(batch, 2)
            inputs = [ib.prepare(mb) for mb in parts]
            for mb, inp in zip(parts, inputs):
                check_inputs(inp, reference(core, mb), mb, core)
        check_arrays(ib, core)
        core.complete(plan, data)


def test_rows_and_columns_grow_and_rows_are_reused():
    """Past the first 16 rows, 256 token columns and 16 block columns; a finished request's row goes to
    the next admitted one, padded with zeros past its (shorter) table."""
    core, ib = Core(), InputBatch(BLOCK, torch.device("cpu"), VOCAB)
    rng = np.random.default_rng(0)
    for i in range(40):
        core.admit(rng.integers(0, VOCAB, 300 if i == 7 else 5).tolist(), 0)

    b = ScheduledBatch()
    for rid, r in core.reqs.items():
        n = len(r["tokens"])
        r["blocks"] = core.blocks(-(-n // BLOCK))
        b.req_ids.append(rid)
        b.num_scheduled_tokens.append(n)
        b.num_sample_rows.append(1)
        b.new_requests.append(NewRequestData(rid, list(r["tokens"]), n, list(r["blocks"]), 0, SamplingParams(), None))
        r["sent"] = (n, len(r["blocks"]))
    ib.update(b)
    check_inputs(ib.prepare(b), reference(core, b), b)
    assert ib.token_ids.shape[0] >= 40 and ib.token_ids.shape[1] >= 300 and ib.block_table.shape[2] >= 75
    check_arrays(ib, core)
    row7 = ib.requests["r7"].row
    core.finish("r7")
    core.admit([1, 2, 3], 0)
    r = core.reqs["r40"]
    r["blocks"] = core.blocks(1)
    b = ScheduledBatch(req_ids=["r40"], num_scheduled_tokens=[3], num_sample_rows=[1],
                       finished_req_ids=core.finished,
                       new_requests=[NewRequestData("r40", [1, 2, 3], 3, list(r["blocks"]), 0, SamplingParams(), None)])
    r["sent"] = (3, 1)
    ib.update(b)
    assert ib.requests["r40"].row == row7
    check_arrays(ib, core)
    check_inputs(ib.prepare(b), reference(core, b), b)


def test_positions_past_the_block_table_raise():
    """A step reaching past a request's blocks (a bookkeeping bug upstream) fails loudly instead of writing
    its KV into block 0's slots, another request's memory."""
    ib = InputBatch(BLOCK, torch.device("cpu"), VOCAB)
    b = ScheduledBatch(req_ids=["a"], num_scheduled_tokens=[BLOCK + 1], num_sample_rows=[1], new_requests=[
        NewRequestData("a", list(range(BLOCK + 1)), BLOCK + 1, [3], 0, SamplingParams(), None)])
    ib.update(b)
    with pytest.raises(IndexError, match="request a"):
        ib.prepare(b)


def test_a_request_with_the_wrong_number_of_tables_is_refused():
    ib = InputBatch(BLOCK, torch.device("cpu"), VOCAB, 2)
    b = ScheduledBatch(req_ids=["a"], num_scheduled_tokens=[2], num_sample_rows=[1], new_requests=[
        NewRequestData("a", [1, 2], 2, [3], 0, SamplingParams(), None)])
    with pytest.raises(ValueError, match="1 KV cache group.*keeps 2"):
        ib.update(b)
