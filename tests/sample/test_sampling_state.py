"""Per-request sampling state (tokenmill/sample/state.py) held by the worker's input batch: converted once
at admission, updated with each step's accepted tokens, and equal step after step to the reference built
from whole lists (SamplingMetadata.build), through drafts, preemption and slot reuse."""
from __future__ import annotations

import random

import torch

from tokenmill.core.batch import CachedRequestData, NewRequestData, ScheduledBatch
from tokenmill.executor.input_batch import InputBatch
from tokenmill.sample.draws import position_seed
from tokenmill.sample.sampler import Sampler, SamplingMetadata, apply_penalties
from tokenmill.sample.state import SamplingState
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
EOS = (5,)


class Driver:
    """Plays the core's part: sends each request in full once (again after a preemption), then diffs."""

    def __init__(self, vocab_size: int) -> None:
        self.V = vocab_size
        self.batch = InputBatch(BLOCK, torch.device("cpu"), vocab_size)
        self.reqs: dict[str, dict] = {}  # rid -> tokens, prompt length, params, seed, whether the worker has it
        self.finished: list[str] = []

    def admit(self, rid: str, prompt: list[int], params: SamplingParams, seed: int | None = None) -> None:
        self.reqs[rid] = dict(tokens=list(prompt), num_prompt=len(prompt), params=params, seed=seed, sent=None)

    def finish(self, rid: str) -> None:
        del self.reqs[rid]
        self.finished.append(rid)

    def preempt(self, rid: str, tell: bool = True) -> None:
        """Forget the worker's copy: the request is sent again in full (prompt + output) and recomputed.
        tell=False: re-sent without being named finished first (the worker must still start it afresh)."""
        self.reqs[rid]["sent"] = None
        if tell:
            self.finished.append(rid)

    def step(self, spec: dict[str, list[int]] | None = None):
        """Schedule every request (decode: 1 token plus its drafts; new: the whole sequence) and return the
        step's inputs after the worker applied the batch."""
        spec = spec or {}
        b = ScheduledBatch(finished_req_ids=self.finished)
        self.finished = []
        for rid, r in self.reqs.items():
            n_tok = len(r["tokens"])
            blocks = list(range(64))  # room for every test: 256 positions
            sp = spec.get(rid, []) if r["sent"] is not None else []
            b.req_ids.append(rid)
            b.num_sample_rows.append(len(sp) + 1)
            if sp:
                b.spec_token_ids[rid] = sp
            if r["sent"] is None:
                b.num_scheduled_tokens.append(n_tok)
                b.new_requests.append(NewRequestData(rid, list(r["tokens"]), r["num_prompt"], blocks, 0,
                                                     r["params"], r["seed"], EOS))
            else:
                b.num_scheduled_tokens.append(1 + len(sp))
                b.cached_requests.append(CachedRequestData(rid, r["tokens"][r["sent"]:], [], n_tok - 1, len(blocks)))
            r["sent"] = n_tok
        self.batch.update(b)
        return (self.batch.prepare(b) if b else None), b  # the runner prepares nothing for an empty step

    def accept(self, rid: str, tokens: list[int]) -> None:
        self.reqs[rid]["tokens"].extend(tokens)

    def reference(self, inp) -> SamplingMetadata:
        """The same step's metadata built from this driver's own lists, as the runner did before the state
        existed: row j of a request counts its first j drafts as output and is banned (min_tokens) by its
        own output position."""
        params, prompts, outputs, gens, banned = [], [], [], [], []
        for r, rows, sp in zip(inp.requests, inp.rows_per_request, inp.spec):
            mine = self.reqs[r.req_id]
            p, n = mine["params"], mine["num_prompt"]
            out = mine["tokens"][n:]
            for j in range(rows):
                params.append(p)
                prompts.append(mine["tokens"][:n])
                outputs.append(out + sp[:j])
                # Seeded rows are keyed by the output position they sample.
                gens.append(None if mine["seed"] is None else position_seed(mine["seed"], len(out) + j))
                ban = [] if len(out) + j >= p.min_tokens else list(p.stop_token_ids) + (
                    [] if p.ignore_eos else list(EOS))
                banned.append(ban)
        return SamplingMetadata.build(params, prompts, outputs, gens, banned, self.V)


def dense(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """An absent tensor is the same as all zero / all False."""
    return torch.zeros_like(like) if t is None else t


def assert_same_meta(got: SamplingMetadata, ref: SamplingMetadata, vocab_size: int) -> None:
    S = len(ref.temperature)
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    for name, dtype in (("logit_bias", torch.float32), ("banned", torch.bool)):
        like = torch.zeros(S, vocab_size, dtype=dtype)
        assert torch.equal(dense(getattr(got, name), like), dense(getattr(ref, name), like)), name
    # Counts and the prompt mask matter only on rows with a penalty (the reference fills every row).
    rep = ref.repetition_penalty != 1.0
    penalised = rep | (ref.presence_penalty != 0.0) | (ref.frequency_penalty != 0.0)
    if penalised.any():
        assert torch.equal(got.output_counts[penalised], ref.output_counts[penalised])
    if rep.any():
        assert torch.equal(got.prompt_mask[rep], ref.prompt_mask[rep])
    for name in ("all_greedy", "max_num_logprobs", "need_logprobs", "use_top_k", "use_top_p", "use_min_p"):
        assert getattr(got, name) == getattr(ref, name), name
    assert (got.seeds is None and ref.seeds is None) or torch.equal(got.seeds, ref.seeds)


def test_vocabulary_sized_logit_bias_matches_reference_and_is_converted_once(monkeypatch):
    V, steps = 4096, 12
    calls = []
    add = SamplingState.add

    def counting_add(self, params, *args, **kw):
        calls.append(params)
        return add(self, params, *args, **kw)

    monkeypatch.setattr(SamplingState, "add", counting_add)
    g = torch.Generator().manual_seed(0)
    bias = {t: float(v) for t, v in enumerate((torch.randn(V, generator=g) * 3).tolist())}  # every id
    d = Driver(V)
    for i in range(4):  # two greedy, two seeded sampling rows, all with the whole-vocabulary bias
        greedy = i < 2
        d.admit(f"b{i}", [1, 2, 3], SamplingParams(temperature=0.0 if greedy else 0.8, logit_bias=bias),
                 seed=None if greedy else 100 + i)
    d.admit("plain", [4], SamplingParams(temperature=0.0))
    bias_row = torch.tensor([bias[t] for t in range(V)])
    for step in range(steps):
        inp, _ = d.step()
        meta = d.batch.sampling_metadata(inp)
        ref = d.reference(inp)
        logits = torch.randn(len(inp.requests), V, generator=g)
        got = Sampler()(logits, meta).token_ids
        want = Sampler()(logits, ref).token_ids
        assert got.tolist() == want.tolist(), f"step {step}"
        direct = (logits[:2] + bias_row).argmax(-1)  # the greedy rows: logits + bias, then argmax
        assert got[:2].tolist() == direct.tolist()
        assert got[4].item() == logits[4].argmax().item()
        for r, t in zip(inp.requests, got.tolist()):
            d.accept(r.req_id, [t])
    assert len(calls) == 5, "the state must be converted once per request, not per step"


def test_penalty_counts_updated_incrementally_equal_recount_through_drafts_and_preemption():
    V = 64
    rng = random.Random(0)
    d = Driver(V)
    params = {
        "rep": SamplingParams(temperature=0.0, repetition_penalty=1.3),
        "freq": SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.4),
        "all": SamplingParams(temperature=0.7, repetition_penalty=0.8, frequency_penalty=1.5, presence_penalty=0.5,
                              top_k=5, logprobs=2),
        "none": SamplingParams(temperature=0.0),
    }
    for rid, p in params.items():
        d.admit(rid, [rng.randrange(V) for _ in range(rng.randrange(1, 12))], p)
    g = torch.Generator().manual_seed(1)
    for step in range(40):
        if step in (10, 25):
            d.preempt("freq")  # finished, then re-sent in full: counts rebuilt from its tokens
        if step == 18:
            d.preempt("rep", tell=False)
        if step == 30:  # a request ends and a new one takes its slot (and its vocabulary rows)
            d.finish("all")
            d.admit("late", [rng.randrange(V) for _ in range(5)], SamplingParams(temperature=0.0, presence_penalty=1.0))
        spec = {rid: [rng.randrange(V) for _ in range(rng.randrange(0, 4))] for rid in d.reqs if step % 3}
        inp, _ = d.step(spec)
        meta, ref = d.batch.sampling_metadata(inp), d.reference(inp)
        assert_same_meta(meta, ref, V)
        logits = torch.randn(len(meta.temperature), V, generator=g)
        assert torch.equal(apply_penalties(logits, meta), apply_penalties(logits, ref))
        for r, sp in zip(inp.requests, inp.spec):
            accepted = rng.randrange(len(sp) + 1)  # some drafts accepted, then one more token
            d.accept(r.req_id, sp[:accepted] + [rng.randrange(V)])


def test_min_tokens_bans_each_draft_row_by_its_output_position_and_is_released_when_met():
    V = 32
    d = Driver(V)
    p = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[7, 9])
    d.admit("a", [1, 2], p)
    d.admit("no_eos_ban", [3], SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True))
    inp, _ = d.step()
    for r in inp.requests:
        d.accept(r.req_id, [1, 1, 1])  # 3 output tokens each
    inp, _ = d.step({"a": [11, 12, 13], "no_eos_ban": [11, 12, 13]})
    meta = d.batch.sampling_metadata(inp)
    # Rows score output tokens 3, 4, 5, 6: only 3 and 4 are before min_tokens=5.
    banned = meta.banned
    ids = [set(torch.nonzero(row).flatten().tolist()) for row in banned]
    assert ids[:4] == [{7, 9, *EOS}, {7, 9, *EOS}, set(), set()]
    assert ids[4:] == [set()] * 4  # ignore_eos and no stop ids: nothing to ban
    assert_same_meta(meta, d.reference(inp), V)
    for r in inp.requests:
        d.accept(r.req_id, [11, 12])  # 5 output tokens: min_tokens met
    inp, _ = d.step()
    assert d.batch.sampling_metadata(inp).banned is None
    assert d.batch.sampling.ban.table is None  # the row was released, and with it the table


def test_slots_and_rows_are_reused_clean_and_tables_freed():
    V = 16
    d = Driver(V)
    d.admit("biased", [1], SamplingParams(temperature=0.0, logit_bias={3: 5.0}, frequency_penalty=1.0))
    inp, _ = d.step()
    d.accept("biased", [3, 3])
    d.finish("biased")
    d.admit("plain", [2], SamplingParams(temperature=0.0))
    d.admit("other_bias", [2], SamplingParams(temperature=0.0, logit_bias={4: -1.0}, presence_penalty=1.0))
    inp, _ = d.step()
    meta = d.batch.sampling_metadata(inp)
    assert_same_meta(meta, d.reference(inp), V)
    assert meta.logit_bias[1].nonzero().flatten().tolist() == [4]  # nothing left of the first request's bias
    assert meta.output_counts.sum().item() == 0
    d.finish("plain")
    d.finish("other_bias")
    d.step()
    s = d.batch.sampling
    assert s.bias.table is None and s.counts.table is None and s.prompt.table is None
    assert sorted(s.free_slots) == list(range(len(s.min_tokens)))


def test_huge_stop_list_with_min_tokens_bans_its_unique_ids():
    V = 1000
    d = Driver(V)
    stop = [t % V for t in range(50_000)] + [V + 5, -3]  # repeats and out-of-vocabulary ids
    d.admit("a", [1], SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=stop))
    inp, _ = d.step()
    meta = d.batch.sampling_metadata(inp)
    assert meta.banned.sum().item() == V
    logits = torch.randn(1, V)
    assert torch.isinf(apply_penalties(logits, meta)).all()


def _meta_values(meta: SamplingMetadata) -> dict:
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()}


def test_an_unchanged_step_reuses_its_metadata_and_any_change_rebuilds_it():
    """metadata() returns the last step's values again for the same slots and rows when nothing it read can have
    changed (no seeds, no vocabulary-wide table), always as a new object; a slot whose request changed (removed,
    another added in its place), other rows, a seed or a penalty table each give freshly built values."""
    import numpy as np

    st = SamplingState(32, "cpu")
    a = st.add(SamplingParams(temperature=0.0, logprobs=2), [1, 2], 2, EOS)
    b = st.add(SamplingParams(temperature=0.7, top_p=0.9), [3], 1, EOS)
    slots, rows, n_out = np.array([a, b]), np.array([1, 1]), np.array([0, 0])
    first = st.metadata(slots, rows, n_out, [[], []], [None, None])
    first.grammar_rows = torch.tensor([0])  # what the runner attaches must not leak into the next step
    again = st.metadata(slots, rows, n_out + 1, [[], []], [None, None])
    assert again is not first and again.grammar_rows is None
    assert _meta_values(again) == _meta_values(st._build_metadata(slots, rows, n_out + 1, [[], []], [None, None]))
    st.remove(b)
    c = st.add(SamplingParams(temperature=1.5, top_k=5), [4], 1, EOS)
    assert c == b  # the slot is reused by a request with other parameters
    changed = st.metadata(slots, rows, n_out, [[], []], [None, None])
    assert changed.temperature.tolist() == [0.0, 1.5] and changed.top_k.tolist()[1] == 5
    assert st.metadata(slots[:1], rows[:1], n_out[:1], [[]], [None]).temperature.tolist() == [0.0]
    seeded = st.metadata(slots, rows, n_out, [[], []], [7, None])
    assert seeded.seeds is not None and seeded.seeds.tolist()[0] == position_seed(7, 0)
    d = st.add(SamplingParams(temperature=0.0, repetition_penalty=1.2), [1, 1, 2], 3, EOS)
    both = np.array([a, d])
    for _ in range(2):  # a penalty table in use: built every time, each with the prompt's tokens marked
        meta = st.metadata(both, rows, n_out, [[], []], [None, None])
        assert meta.prompt_mask is not None and meta.prompt_mask[1, :3].tolist() == [False, True, True]
