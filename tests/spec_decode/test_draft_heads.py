"""Draft heads (EAGLE-1, EAGLE-3, MTP) loaded from checkpoints in the published layouts and run over a
real paged KV cache: copy heads reproduce a bigram target's next-next token, KV lands at the given
slots, bad folders fail naming what is wrong, and MTP tensors do not disturb the target."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_heads_tiny import (PagedSequence, add_mtp_layers, make_bigram_target, write_eagle3_head,
                              write_eagle_head)
from tiny import make_tiny_model
from tokenmill.model.loader import load_model
from tokenmill.spec_decode.heads import load_draft_head

F32 = torch.float32
SEQ = 20


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama")


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory, tiny_target) -> Path:
    path = tmp_path_factory.mktemp("bigram")
    shutil.copytree(tiny_target, path, dirs_exist_ok=True)
    return make_bigram_target(path)


def load_target(path):
    return load_model(str(path), dtype="float32")[0]


def head_for(method: str, tmp_path: Path, target_dir: Path, copy: bool, **kw):
    if method == "eagle":
        return write_eagle_head(tmp_path / "head", target_dir, copy=copy, **kw), target_dir
    if method == "eagle3":
        return write_eagle3_head(tmp_path / "head", target_dir, copy=copy, **kw), target_dir
    mtp_target = tmp_path / "target"
    shutil.copytree(target_dir, mtp_target)
    return None, add_mtp_layers(mtp_target, copy=copy)


def tokens(vocab: int, n: int = SEQ, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def target_features(target, ids: torch.Tensor, aux: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(target greedy token after each position, the head's first-step features)."""
    target.aux_hidden_layers = aux
    seq = PagedSequence([m.self_attn.attn for m in target.layers])
    hidden = target(ids, torch.arange(len(ids)), seq.meta(0, len(ids)))
    feats = target.aux_hidden_states if aux else hidden
    return target.compute_logits(hidden).argmax(-1), feats


@torch.inference_mode()
def run_head(head, ids: torch.Tensor, feats: torch.Tensor, chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over positions 0..len-1 in passes of `chunks` tokens: (next features, logits)."""
    seq = PagedSequence(head.attention_layers())
    outs, logits, start = [], [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)
        nxt, hidden = head(ids[pos], pos, feats[pos], seq.meta(start, n))
        outs.append(nxt)
        logits.append(head.compute_logits(hidden))
        start += n
    return torch.cat(outs), torch.cat(logits)


def load(method, head_dir, target, target_dir):
    return load_draft_head(method, None if head_dir is None else str(head_dir), target, str(target_dir), F32, F32, 512)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_copy_head_predicts_the_bigram_targets_next_next_token(method, tmp_path, bigram_target):
    head_dir, target_dir = head_for(method, tmp_path, bigram_target, copy=True)
    target = load_target(target_dir)
    head = load(method, head_dir, target, target_dir)
    assert head.method == method
    ids = tokens(target.spec.vocab_size)
    greedy, feats = target_features(target, ids, head.aux_layers)
    # Head input at p: (t_{p+1}, f_p); it should predict the target's choice after t_{p+1}.
    _, logits = run_head(head, ids[1:], feats[:-1], [SEQ - 1])
    assert logits.shape == (SEQ - 1, target.spec.vocab_size) and logits.dtype == F32
    assert logits.argmax(-1).tolist() == greedy[1:].tolist()


def test_eagle3_reduced_draft_vocab_maps_back_and_masks_the_rest(tmp_path, bigram_target):
    target = load_target(bigram_target)
    vocab = target.spec.vocab_size
    ids = tokens(vocab)
    greedy, _ = target_features(target, ids)
    subset = sorted(set(torch.randperm(vocab, generator=torch.Generator().manual_seed(5))[: vocab // 2].tolist())
                    | set(greedy[1:].tolist()))
    head_dir = write_eagle3_head(tmp_path / "head", bigram_target, copy=True, draft_tokens=subset)
    head = load("eagle3", head_dir, target, bigram_target)
    _, feats = target_features(target, ids, head.aux_layers)
    _, logits = run_head(head, ids[1:], feats[:-1], [SEQ - 1])
    excluded = torch.ones(vocab, dtype=torch.bool)
    excluded[subset] = False
    assert torch.isneginf(logits[:, excluded]).all() and torch.isfinite(logits[:, ~excluded]).all()
    assert logits.argmax(-1).tolist() == greedy[1:].tolist()


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_random_head_kv_lands_at_the_given_slots(method, tmp_path, tiny_target):
    head_dir, target_dir = head_for(method, tmp_path, tiny_target, copy=False)
    target = load_target(target_dir)
    head = load(method, head_dir, target, target_dir)
    ids = tokens(target.spec.vocab_size, 11)
    _, feats = target_features(target, ids, head.aux_layers)
    ids, feats = ids[1:], feats[:-1]
    one = run_head(head, ids, feats, [10])
    two = run_head(head, ids, feats, [5, 5])
    for a, b in zip(one, two):
        assert a.shape[0] == 10 and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # A later draft step reads the head's own feature [T, H].
    nxt, hidden = head(ids[:3], torch.arange(3), one[0][:3], PagedSequence(head.attention_layers()).meta(0, 3))
    assert nxt.shape == hidden.shape == (3, target.spec.hidden_size)


def _drop(path: Path, name: str) -> None:
    w = load_file(str(path / "model.safetensors"))
    del w[name]
    save_file(w, str(path / "model.safetensors"))


def _reshape(path: Path, name: str) -> None:
    w = load_file(str(path / "model.safetensors"))
    w[name] = torch.zeros(w[name].shape[0], w[name].shape[1] + 1)
    save_file(w, str(path / "model.safetensors"))


def test_bad_head_folders_fail_naming_what_is_wrong(tmp_path, tiny_target):
    target = load_target(tiny_target)
    eagle = write_eagle_head(tmp_path / "eagle", tiny_target, copy=False)
    _drop(eagle, "layers.0.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensors: layers\.0\.self_attn\.k_proj\.weight"):
        load("eagle", eagle, target, tiny_target)
    eagle3 = write_eagle3_head(tmp_path / "eagle3", tiny_target, copy=False)
    _reshape(eagle3, "fc.weight")
    with pytest.raises(ValueError, match=r"fc\.weight"):
        load("eagle3", eagle3, target, tiny_target)
    eagle3b = write_eagle3_head(tmp_path / "eagle3b", tiny_target, copy=False)
    _drop(eagle3b, "midlayer.hidden_norm.weight")
    with pytest.raises(ValueError, match=r"midlayer\.hidden_norm\.weight"):
        load("eagle3", eagle3b, target, tiny_target)
    (eagle3b / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        load("eagle3", eagle3b, target, tiny_target)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        load("mtp", None, target, tiny_target)
    mtp_dir = tmp_path / "mtp"
    shutil.copytree(tiny_target, mtp_dir)
    add_mtp_layers(mtp_dir, copy=True)
    _drop(mtp_dir, "model.layers.2.enorm.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.enorm\.weight"):
        load("mtp", None, load_target(mtp_dir), mtp_dir)
    with pytest.raises(ValueError, match="unknown draft head method"):
        load("hydra", None, target, tiny_target)


def test_target_with_mtp_tensors_loads_as_the_plain_target(tmp_path, tiny_target):
    mtp_dir = tmp_path / "mtp"
    shutil.copytree(tiny_target, mtp_dir)
    add_mtp_layers(mtp_dir, copy=False)
    assert json.loads((mtp_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    plain, with_mtp = load_target(tiny_target), load_target(mtp_dir)
    assert len(with_mtp.layers) == len(plain.layers)
    ids = tokens(plain.spec.vocab_size)
    outs = []
    for model in (plain, with_mtp):
        seq = PagedSequence([m.self_attn.attn for m in model.layers])
        with torch.inference_mode():
            outs.append(model.compute_logits(model(ids, torch.arange(SEQ), seq.meta(0, SEQ))))
    assert torch.equal(outs[0], outs[1])


def test_aux_hidden_states_are_the_residual_stream_after_each_layer(tiny_target):
    import transformers as tf

    target = load_target(tiny_target)
    target.aux_hidden_layers = (-1, 0, 1)
    ids = tokens(target.spec.vocab_size)
    seq = PagedSequence([m.self_attn.attn for m in target.layers])
    with torch.inference_mode():
        hidden = target(ids, torch.arange(SEQ), seq.meta(0, SEQ))
    ref = tf.AutoModelForCausalLM.from_pretrained(tiny_target, dtype=F32)
    with torch.no_grad():
        out = ref.model(ids[None], output_hidden_states=True)
    # transformers' hidden_states[i] enters layer i (0: the embeddings); its last entry is after the final norm.
    h = target.spec.hidden_size
    aux = target.aux_hidden_states
    assert aux.shape == (SEQ, 3 * h)
    torch.testing.assert_close(aux[:, : 2 * h], torch.cat(out.hidden_states[:2], dim=-1)[0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(target.norm(aux[:, 2 * h :]), hidden, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(hidden, out.hidden_states[-1][0], atol=2e-4, rtol=2e-4)
