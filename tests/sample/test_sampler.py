"""Tests for the batched sampler (tokenmill/sample/sampler.py)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tokenmill.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p_min_p,
    compute_logprobs,
)
from tokenmill.sample.draws import position_seed
from tokenmill.sampling_params import SamplingParams

NEG_INF = float("-inf")


def build(params, vocab_size, prompts=None, outputs=None, seeds=None, banned=None):
    B = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(B)],
        outputs if outputs is not None else [[] for _ in range(B)],
        seeds if seeds is not None else [None] * B,
        banned if banned is not None else [[] for _ in range(B)],
        vocab_size,
    )


def filter_meta(top_k=(), top_p=(), min_p=(), B=None):
    """Metadata with only the filter fields set (all flags on, as if built by hand)."""
    B = B or max(len(top_k), len(top_p), len(min_p))
    ones, zeros = torch.ones(B), torch.zeros(B)
    return SamplingMetadata(
        temperature=ones.clone(),
        top_k=torch.tensor(list(top_k) or [0] * B, dtype=torch.int64),
        top_p=torch.tensor(list(top_p) or [1.0] * B, dtype=torch.float32),
        min_p=torch.tensor(list(min_p) or [0.0] * B, dtype=torch.float32),
        repetition_penalty=ones.clone(),
        presence_penalty=zeros.clone(),
        frequency_penalty=zeros.clone(),
        prompt_mask=None,
        output_counts=None,
        logit_bias=None,
        banned=None,
        seeds=None,
        all_greedy=False,
        max_num_logprobs=0,
    )


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row != NEG_INF).flatten().tolist()) for row in masked]


# Probabilities 1/2, 1/4, 1/8, 1/16, 1/16 (cumulative: .5, .75, .875, .9375, 1).
DYADIC = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]).log()


# 1. Greedy ---------------------------------------------------------------------------


def test_all_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    meta = build([SamplingParams(temperature=0.0) for _ in range(8)], 50)
    assert meta.all_greedy
    out = Sampler()(logits, meta)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None and out.ranks is None


def test_greedy_rows_in_mixed_batch():
    torch.manual_seed(0)
    B, V = 64, 32
    logits = torch.randn(B, V) * 0.1  # flat: random rows rarely pick the argmax
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_k=V // 2 if i % 4 == 1 else 0) for i in range(B)]
    meta = build(params, V)
    assert not meta.all_greedy
    sampler = Sampler()
    random_hits_argmax = []
    for _ in range(5):
        ids = sampler(logits, meta).token_ids
        assert torch.equal(ids[0::2], logits[0::2].argmax(-1))
        random_hits_argmax.append(ids[1::2] == logits[1::2].argmax(-1))
    assert not torch.cat(random_hits_argmax).all()


def test_greedy_ties_pick_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert Sampler()(logits, build([SamplingParams(temperature=0.0)], 4)).token_ids.item() == 1


# 2. Seeded reproducibility ---------------------------------------------------------------

V_SEED = 64
TARGET = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=1234)


def step_logits(step: int, row: int) -> torch.Tensor:
    return torch.randn(V_SEED, generator=torch.Generator().manual_seed(1000 * step + row))


def run_seeded(position: int | None, target_seed: int = 1234, steps: int = 20) -> list[int]:
    """Generate `steps` tokens for TARGET, alone (position None) or at `position` in a batch of 16."""
    if position is None:
        params = [TARGET]
        seeds: list[int | None] = [target_seed]
    else:
        others = [
            SamplingParams(temperature=1.0, seed=7),
            SamplingParams(temperature=1.3),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1, presence_penalty=0.5),
            SamplingParams(temperature=1.0, top_k=3, frequency_penalty=1.0, seed=99, logprobs=2),
        ]
        params = [others[i % len(others)] for i in range(15)]
        params.insert(position, TARGET)
        seeds = [p.seed for p in params]
        seeds[position] = target_seed
    target = 0 if position is None else position
    # The target's own prompt wherever it sits (its repetition penalty reads it); the others' differ.
    prompts = [[1, 2, 3, 0 if row == target else row + 1] for row in range(len(params))]
    outputs: list[list[int]] = [[] for _ in params]
    sampler = Sampler()
    torch.manual_seed(position or 0)  # the global RNG differs between runs
    for step in range(steps):
        logits = torch.stack([step_logits(step, row if row != target else -1) for row in range(len(params))])
        keys = [None if s is None else position_seed(s, step) for s in seeds]  # output position = step
        meta = SamplingMetadata.build(params, prompts, outputs, keys, [[] for _ in params], V_SEED)
        ids = sampler(logits, meta).token_ids.tolist()
        for row, t in enumerate(ids):
            outputs[row].append(t)
    return outputs[target]


def test_seeded_row_reproducible_alone_and_in_any_batch_position():
    alone = run_seeded(None)
    assert alone == run_seeded(None)
    assert len(set(alone)) > 3  # really sampling, not a constant
    for position in (0, 7, 15):
        assert run_seeded(position) == alone
    assert run_seeded(None, target_seed=4321) != alone


# 3. Top-k / top-p / min-p ---------------------------------------------------------------


@pytest.mark.parametrize(
    "top_k, expected",
    [(1, {0}), (2, {0, 1}), (3, {0, 1, 2}), (5, set(range(5))), (6, set(range(5))), (100, set(range(5))), (0, set(range(5)))],
)
def test_top_k_mask(top_k, expected):
    masked = apply_top_k_top_p_min_p(DYADIC[None], filter_meta(top_k=[top_k]))
    assert kept(masked) == [expected]
    assert torch.equal(masked[0, list(expected)], DYADIC[list(expected)])  # survivors untouched


def test_top_k_keeps_ties_at_threshold():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0], [3.0, 3.0, 3.0, 0.0]])
    assert kept(apply_top_k_top_p_min_p(logits, filter_meta(top_k=[2, 1]))) == [{0, 1, 2}, {0, 1, 2}]


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (1e-6, {0}),
        (0.3, {0}),
        (0.5, {0}),  # exactly the top token's mass
        (0.51, {0, 1}),
        (0.75, {0, 1}),  # exactly .5 + .25
        (0.76, {0, 1, 2}),
        (0.875, {0, 1, 2}),
        (0.9, {0, 1, 2, 3}),
        (0.99, set(range(5))),
        (1.0, set(range(5))),
    ],
)
def test_top_p_mask(top_p, expected):
    assert kept(apply_top_k_top_p_min_p(DYADIC[None], filter_meta(top_p=[top_p]))) == [expected]


def test_top_p_exact_boundary_on_uniform_breaks_ties_by_id():
    logits = torch.zeros(1, 4)  # probabilities exactly 0.25
    assert kept(apply_top_k_top_p_min_p(logits, filter_meta(top_p=[0.5]))) == [{0, 1}]


@pytest.mark.parametrize("top_p, expected", [(0.38, {1}), (0.96, {0, 1, 2, 3})])
def test_top_p_boundary_survives_float32_rounding(top_p, expected):
    # Masses 19/50 and 48/50 come out of a float32 softmax/cumsum slightly below top_p.
    logits = (torch.tensor([16.0, 19.0, 6.0, 7.0, 2.0]) / 50).log()[None]
    assert kept(apply_top_k_top_p_min_p(logits, filter_meta(top_p=[top_p]))) == [expected]


def test_top_p_applies_to_renormalised_top_k():
    # After top_k=3 the masses are .571, .286, .143: top_p=.8 stops at two tokens,
    # while on the full distribution it needs three.
    masked = apply_top_k_top_p_min_p(DYADIC.expand(2, 5), filter_meta(top_k=[3, 0], top_p=[0.8, 0.8]))
    assert kept(masked) == [{0, 1}, {0, 1, 2}]


@pytest.mark.parametrize(
    "logits, min_p, expected",
    [
        (DYADIC, 0.3, {0, 1}),  # threshold .15
        (DYADIC, 0.2, {0, 1, 2}),  # threshold .1
        (DYADIC, 0.1, set(range(5))),  # threshold .05
        (DYADIC, 1.0, {0}),
        (torch.tensor([2.0, 2.0, 1.0, 2.0]), 1.0, {0, 1, 3}),  # all argmaxes survive
        (DYADIC, 0.0, set(range(5))),
    ],
)
def test_min_p_mask(logits, min_p, expected):
    assert kept(apply_top_k_top_p_min_p(logits[None], filter_meta(min_p=[min_p]))) == [expected]


def test_filters_per_row_in_one_batch():
    meta = filter_meta(top_k=[0, 2, 0, 4, 0, 1], top_p=[1.0, 1.0, 0.75, 0.9, 1.0, 0.5], min_p=[0, 0, 0, 0, 0.3, 0])
    masked = apply_top_k_top_p_min_p(DYADIC.expand(6, 5), meta)
    # row 3: top_k=4 keeps all five (tokens 3 and 4 tie), then top_p=.9 needs four of them
    assert kept(masked) == [set(range(5)), {0, 1}, {0, 1}, {0, 1, 2, 3}, {0, 1}, {0}]


def reference_mask(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Direct, per-row float64 statement of the rules."""
    values = logits.double().tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    keep = set(order)
    if 0 < top_k < len(values):
        kth = values[order[top_k - 1]]
        keep = {i for i in keep if values[i] >= kth}
    if top_p < 1.0:
        total = sum(math.exp(values[i]) for i in keep)
        mass, nucleus = 0.0, set()
        for i in (i for i in order if i in keep):
            nucleus.add(i)
            mass += math.exp(values[i]) / total
            if mass >= top_p:
                break
        keep = nucleus
    top = max(values)
    return {i for i in keep if math.exp(values[i] - top) >= min_p}


def test_filters_match_reference_on_random_rows():
    g = torch.Generator().manual_seed(0)
    B, V = 300, 12
    logits = (torch.randn(B, V, generator=g) * 2).round(decimals=1)  # rounding creates ties
    top_k = torch.randint(0, V + 3, (B,), generator=g)
    top_p = torch.rand(B, generator=g).clamp(min=0.05)
    top_p[::3] = 1.0
    min_p = torch.rand(B, generator=g) * 0.5
    min_p[::2] = 0.0
    meta = filter_meta(top_k=top_k.tolist(), top_p=top_p.tolist(), min_p=min_p.tolist())
    got = kept(apply_top_k_top_p_min_p(logits, meta))
    for row in range(B):
        expected = reference_mask(logits[row], int(top_k[row]), float(top_p[row]), float(min_p[row]))
        assert got[row] == expected, row


def test_sampled_support_is_exactly_the_filtered_set():
    torch.manual_seed(0)
    configs = [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.8), {0, 1, 2}),
        (SamplingParams(top_p=0.75), {0, 1}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),
        (SamplingParams(top_k=1, temperature=2.0), {0}),
        (SamplingParams(min_p=1.0), {0}),
        (SamplingParams(top_k=100), set(range(5))),
        (SamplingParams(), set(range(5))),
    ]
    rows = 2000
    params = [p for p, _ in configs for _ in range(rows)]
    ids = Sampler()(DYADIC.expand(len(params), 5), build(params, 5)).token_ids.view(len(configs), rows)
    for (p, expected), sampled in zip(configs, ids):
        assert set(sampled.tolist()) == expected, p


def test_build_filter_flags_only_for_random_rows():
    meta = build([SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.5), SamplingParams(top_k=10)], 10)
    assert (meta.use_top_k, meta.use_top_p, meta.use_min_p) == (False, False, False)
    meta = build([SamplingParams(top_k=3, top_p=0.5, min_p=0.1)], 10)
    assert (meta.use_top_k, meta.use_top_p, meta.use_min_p) == (True, True, True)
    assert meta.temperature.tolist() == [1.0] and meta.top_k.dtype == torch.int64


# 4. Penalties --------------------------------------------------------------------------


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    B, V = 4, 40
    logits = torch.randn(B, V, generator=g) * 3
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 9, 1, 7)]
    outputs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 0, 6, 4)]
    penalties = [1.3, 0.7, 2.0, 1.0]
    meta = build([SamplingParams(repetition_penalty=p) for p in penalties], V, prompts, outputs)
    assert meta.prompt_mask is not None and meta.output_counts is not None
    got = apply_penalties(logits, meta)
    for row, p in enumerate(penalties):
        input_ids = torch.tensor([prompts[row] + outputs[row]])
        expected = RepetitionPenaltyLogitsProcessor(penalty=p)(input_ids, logits[row : row + 1].clone())[0]
        torch.testing.assert_close(got[row], expected)
    assert not torch.equal(got[0], logits[0])
    assert torch.equal(got[3], logits[3])


def test_presence_and_frequency_penalties_openai_formula():
    g = torch.Generator().manual_seed(1)
    B, V = 3, 20
    logits = torch.randn(B, V, generator=g)
    prompts = [[0, 1, 2, 3]] * B  # prompt tokens are not penalised
    outputs = [[5, 5, 5, 7, 1], [], [19, 0, 19]]
    settings = [(0.5, 0.25), (1.0, 1.0), (-1.0, 2.0)]  # (presence, frequency)
    params = [SamplingParams(presence_penalty=pp, frequency_penalty=fp) for pp, fp in settings]
    meta = build(params, V, prompts, outputs)
    assert meta.prompt_mask is None and meta.output_counts is not None
    got = apply_penalties(logits, meta)
    expected = logits.clone()
    for row, (pp, fp) in enumerate(settings):
        for token, count in Counter(outputs[row]).items():
            expected[row, token] -= fp * count + pp
    torch.testing.assert_close(got, expected)
    assert got[0, 5] == pytest.approx(logits[0, 5].item() - 0.75 - 0.5)


def test_penalty_order_bias_then_repetition():
    logits = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, logit_bias={0: -3.0, 3: 1.0})]
    meta = build(params, 4, prompts=[[0]], outputs=[[2, 2]])
    # token 0: (1 - 3) * 2 (bias before penalty); token 2: -1 * 2 - 0.5 * 2; token 3: only bias
    assert apply_penalties(logits, meta).tolist() == [[-4.0, 1.0, -3.0, 3.0]]


def test_build_skips_unneeded_tensors_and_ignores_padding():
    meta = build([SamplingParams(), SamplingParams(temperature=0.0)], 10, [[1, 2], [3]], [[4], []])
    assert meta.prompt_mask is meta.output_counts is meta.logit_bias is meta.banned is None
    meta = build([SamplingParams(repetition_penalty=1.2), SamplingParams()], 10, [[1, 2, 2, 9], []], [[4, 4], [0]])
    assert meta.prompt_mask.shape == (2, 10) and meta.prompt_mask.dtype == torch.bool
    assert torch.nonzero(meta.prompt_mask).tolist() == [[0, 1], [0, 2], [0, 9]]
    assert meta.output_counts.dtype == torch.float32
    assert torch.nonzero(meta.output_counts).tolist() == [[0, 4], [1, 0]]
    assert meta.output_counts[0, 4].item() == 2.0


def test_out_of_range_ids_are_ignored():
    meta = build(
        [SamplingParams(repetition_penalty=1.5, logit_bias={12: 5.0, 1: 2.0})], 10, [[10, 3]], [[-1]], banned=[[11, 2]]
    )
    assert torch.nonzero(meta.prompt_mask).tolist() == [[0, 3]]
    assert meta.output_counts.sum().item() == 0
    assert torch.nonzero(meta.logit_bias).tolist() == [[0, 1]]
    assert torch.nonzero(meta.banned).tolist() == [[0, 2]]


# 5. Logprobs --------------------------------------------------------------------------


def test_sampler_logprobs_are_of_raw_logits():
    torch.manual_seed(0)
    B, V, N = 6, 30, 4
    logits = torch.randn(B, V)
    params = [
        SamplingParams(temperature=0.0, logprobs=N, repetition_penalty=1.5, logit_bias={3: 10.0}),
        SamplingParams(temperature=0.5, top_k=5, logprobs=1),
        SamplingParams(temperature=2.0, presence_penalty=2.0),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.2, logprobs=0),
    ]
    meta = build(params, V, prompts=[[1, 2]] * B, outputs=[[3, 4]] * B)
    assert meta.max_num_logprobs == N
    original = logits.clone()
    out = Sampler()(logits, meta)
    assert torch.equal(logits, original)  # the caller's logits are not modified
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.dtype == out.top_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == out.top_ids.shape == (B, N)
    sorted_ref, sorted_ids = ref.sort(dim=-1, descending=True)
    torch.testing.assert_close(out.top_logprobs, sorted_ref[:, :N])
    assert torch.equal(out.top_ids, sorted_ids[:, :N])
    for row in range(B):
        token = out.token_ids[row].item()
        assert out.ranks[row].item() == 1 + int((ref[row] > ref[row, token]).sum())
    assert out.token_ids[0].item() == 3  # the bias moved the greedy pick ...
    assert out.ranks[0].item() == 1 + int((logits[0] > logits[0, 3]).sum())  # ... but not the raw rank


def test_logprobs_zero_still_returns_sampled_token_logprob():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=0)], 3))
    assert out.top_logprobs.shape == (1, 0) and out.top_ids.shape == (1, 0)
    assert out.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())
    assert out.ranks.tolist() == [1]


def test_compute_logprobs_on_prompt_tokens():
    g = torch.Generator().manual_seed(3)
    T, V = 9, 25
    logits = torch.randn(T, V, generator=g).to(torch.bfloat16)
    tokens = torch.randint(0, V, (T,), generator=g)
    token_lp, top_lp, top_ids, ranks = compute_logprobs(logits, tokens, 3)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert token_lp.dtype == top_lp.dtype == torch.float32
    torch.testing.assert_close(token_lp, ref[torch.arange(T), tokens])
    assert top_lp.shape == top_ids.shape == (T, 3)
    assert (top_lp[:, :-1] >= top_lp[:, 1:]).all()
    torch.testing.assert_close(top_lp, ref.gather(1, top_ids))
    torch.testing.assert_close(top_lp[:, 0], ref.max(dim=-1).values)
    expected_ranks = [1 + sum(v > ref[t, tokens[t]].item() for v in ref[t].tolist()) for t in range(T)]
    assert ranks.tolist() == expected_ranks
    assert compute_logprobs(logits, tokens, 100)[1].shape == (T, V)  # top-N capped at the vocab


# 6. Banned tokens and logit bias -----------------------------------------------------------


def test_banned_tokens_never_sampled():
    torch.manual_seed(0)
    V, B = 10, 1000
    logits = torch.zeros(B, V)
    logits[:, 2] = 8.0  # banned token 2 is by far the most likely
    logits[:, 7] = 4.0
    params = [SamplingParams(temperature=0.0 if i % 10 == 0 else 1.5) for i in range(B)]
    meta = build(params, V, banned=[[2, 7]] * B)
    ids = Sampler()(logits, meta).token_ids
    assert not torch.isin(ids, torch.tensor([2, 7])).any()
    assert len(set(ids.tolist())) == V - 2
    assert build(params[:1], V).banned is None


def test_logit_bias_shifts_argmax():
    logits = torch.tensor([[3.0, 1.0, 0.0, 2.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, logit_bias={2: 3.5}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={0: -100.0}),
    ]
    assert Sampler()(logits, build(params, 4)).token_ids.tolist() == [2, 0, 3]


# 7. Distribution ----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution(temperature):
    torch.manual_seed(0)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 20000
    ids = Sampler()(probs.log().expand(rows, 4), build([SamplingParams(temperature=temperature)] * rows, 4)).token_ids
    freq = torch.bincount(ids, minlength=4).float() / rows
    expected = probs ** (1 / temperature)
    expected /= expected.sum()
    assert (freq - expected).abs().max().item() < 0.02


def test_seeded_rows_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 20000
    keys = [position_seed(i, 0) for i in range(rows)]
    ids = Sampler()(probs.log().expand(rows, 4), build([SamplingParams(seed=0)] * rows, 4, seeds=keys)).token_ids
    freq = torch.bincount(ids, minlength=4).float() / rows
    assert (freq - probs).abs().max().item() < 0.02


def test_sampled_tokens_and_logprobs_come_back_in_one_host_copy():
    """Issue 31: a step's sampled tokens, their logprobs and a verification's accepted counts reach the host in
    one copy (each copy is a device sync on a GPU), with exactly the values per-tensor copies gave."""
    from tokenmill.sample.sampler import SamplerOutput

    class Counted(torch.Tensor):
        copies = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            # the calls that copy a device tensor to the host (numpy() of a device tensor raises instead)
            if func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.to):
                Counted.copies += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    g = torch.Generator().manual_seed(0)
    B, N = 6, 5
    out = SamplerOutput(token_ids=torch.randint(0, 49152, (B,), generator=g),
                        logprobs=-torch.rand(B, generator=g) * 20, top_logprobs=-torch.rand(B, N, generator=g),
                        top_ids=torch.randint(0, 49152, (B, N), generator=g), ranks=torch.randint(1, 49152, (B,), generator=g))
    want = (out.token_ids.tolist(), (out.logprobs.tolist(), out.ranks.tolist(), out.top_ids.tolist(),
                                     out.top_logprobs.tolist()))
    counted = SamplerOutput(*(t.as_subclass(Counted) for t in (out.token_ids, out.logprobs, out.top_logprobs,
                                                                 out.top_ids, out.ranks)))
    accepted = torch.tensor([0, 3, 1]).as_subclass(Counted)  # a verification's accepted drafts per request
    tokens, lp, counts = counted.to_host(accepted)
    assert Counted.copies == 1
    assert (tokens, lp) == want and counts == [0, 3, 1]
    Counted.copies = 0
    tokens, lp, counts = SamplerOutput(out.token_ids.as_subclass(Counted), None, None, None, None).to_host()
    assert Counted.copies == 1 and tokens == want[0] and lp is None and counts is None
