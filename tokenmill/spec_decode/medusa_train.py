"""`tokenmill train-medusa`: Medusa heads for a model, trained on its own continuations (self-distillation, the
Medusa-2 recipe: no dataset to download, and the heads learn what this model will say, which is what speculation
needs).

1. Corpus: the model continues the prompts shipped here (`PROMPTS`: six kinds of instruction over forty topics)
   through its chat template, at --temperature.
2. Features: one forward per sequence over prompt + continuation with the engine's own model and attention
   backend, keeping the final hidden state (after the last norm) at every position.
3. Heads: head i maps the hidden state at position p to the token at p + 2 + i through `--layers` residual blocks
   (x + SiLU(W x + b), W and b zero at the start, so every head begins as the LM head: Medusa's initialisation)
   and the target's own LM head, frozen (so the heads need no vocabulary projection of their own: the published
   layout without `medusa_head.{i}.{L}.weight`, read by spec_decode/medusa.py). Cross-entropy on the positions of
   the continuations over the tokens the corpus uses (a few thousand of SmolLM2's 49k: the softmax over the whole
   vocabulary would cost 15x more per step on the CPU, and the heads are meant for what this model says), Adam;
   a tenth of the sequences held out for the accuracy report (over the full vocabulary, as serving sees it).
   Continuations are greedy by default (--temperature 0): the heads then learn what greedy decoding will emit.

Written: `config.json` (medusa_num_heads, medusa_num_layers, base_model_name_or_path) and
`medusa_lm_head.safetensors`; the report gives each head's top-1 and top-3 accuracy on the held-out positions.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# The corpus's prompts: instructions of the kinds a chat model serves, over topics (templates x topics: 240
# prompts; the heads generalise with the variety, 48 hand-written prompts left them at 12 % held-out top-1).
TEMPLATES = ["Explain {t} in simple terms.", "Write a short paragraph about {t}.", "What are three facts about {t}?",
             "Give a beginner's guide to {t}.", "Why does {t} matter? Answer briefly.",
             "Write a short story that involves {t}."]
TOPICS = ["photosynthesis", "black holes", "the French revolution", "volcanoes", "machine learning", "the ocean",
          "coffee", "electric cars", "the human heart", "ancient Rome", "climate change", "chess", "honeybees",
          "the internet", "vaccines", "the moon landing", "recycling", "jazz music", "earthquakes", "the stock market",
          "mountains", "solar panels", "dinosaurs", "the printing press", "sleep", "rainforests", "Python programming",
          "democracy", "the immune system", "trains", "gravity", "friendship", "bread baking", "the Olympic games",
          "deserts", "telescopes", "the water cycle", "penguins", "smartphones", "the Renaissance"]
PROMPTS = [t.format(t=topic) for topic in TOPICS for t in TEMPLATES]


@dataclass
class TrainReport:
    out: Path
    sequences: int
    positions: int
    seconds: float
    top1: list[float]  # per head, held-out
    top3: list[float]


def _corpus(llm, prompts: list[str], max_tokens: int, temperature: float, seed: int) -> list[tuple[list[int], int]]:
    """(prompt + continuation token ids, prompt length) per prompt, sampled from the model itself."""
    from tokenmill import SamplingParams

    tok = llm.get_tokenizer()
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    return [(list(i) + list(o.outputs[0].token_ids), len(i)) for i, o in zip(ids, outs)]


@torch.inference_mode()
def _features(llm, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The model's final hidden states at every position of each sequence (one forward each, through the engine's
    runner and attention backend, into the then idle KV pool)."""
    from tokenmill.executor.input_batch import pack_layout

    runner = llm.engine.core.executor.worker.runner
    if len(runner.kv_groups) > 1:
        raise ValueError("train-medusa: models with several KV cache groups are not supported (run with "
                         "--disable-hybrid-kv-cache-manager).")
    bs, out = runner.block_size, []
    for seq in seqs:
        nb = -(-len(seq) // bs)
        if nb + 1 > runner.num_blocks:
            raise ValueError(f"train-medusa: a sequence of {len(seq)} tokens needs more KV blocks than the pool has")
        layout, positions = pack_layout(np.array([0]), np.array([len(seq)]), [list(range(1, nb + 1))], bs)
        meta = runner.backend.build_metadata(layout)
        hidden = runner.model(torch.tensor(seq, device=runner.device), torch.from_numpy(positions).to(runner.device),
                              meta)
        out.append(hidden.float().cpu().clone())
    return out


@torch.inference_mode()
def _embed(llm, ids: torch.Tensor) -> torch.Tensor:
    """The target's embeddings of token ids, as float32 on the CPU (train-eagle's and train-dflash's inputs)."""
    runner = llm.engine.core.executor.worker.runner
    return runner.model.embed_tokens(ids.to(runner.device)).float().cpu().clone()


def _lm_head_weight(llm) -> torch.Tensor:
    """The target's LM head as a float [V, H] matrix (read back through its own forward: any storage format)."""
    runner = llm.engine.core.executor.worker.runner
    model = runner.model
    with torch.inference_mode():
        w = model.lm_head.compute_logits(torch.eye(model.spec.hidden_size, dtype=model.compute_dtype,
                                                   device=runner.device))
    return w.float().cpu().T.contiguous().clone()


def _examples(feats: list[torch.Tensor], seqs: list[tuple[list[int], int]], heads: int):
    """(hidden [N, H], targets [N, heads], mask [N, heads]) over the continuations' positions: head i's target at
    position p is the token at p + 2 + i."""
    xs, ys, ms = [], [], []
    for h, (seq, plen) in zip(feats, seqs):
        L = len(seq)
        pos = torch.arange(plen - 1, L - 2)  # from the prompt's last token (it predicts the first output)
        if pos.numel() == 0:
            continue
        tok = torch.tensor(seq)
        idx = pos.unsqueeze(1) + 2 + torch.arange(heads).unsqueeze(0)  # [n, heads]
        ok = idx < L
        xs.append(h[pos])
        ys.append(torch.where(ok, tok[idx.clamp(max=L - 1)], 0))
        ms.append(ok)
    return torch.cat(xs), torch.cat(ys), torch.cat(ms)


def train_medusa(model: str | None, out: str, heads: int = 4, layers: int = 1, steps: int = 1000, batch: int = 256,
                 lr: float = 3e-3, max_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
                 prompts: list[str] | None = None, **engine_kw) -> TrainReport:
    from safetensors.torch import save_file

    from tokenmill import LLM

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    llm = LLM(model, enable_prefix_caching=False, distributed_executor_backend="uni", **engine_kw)
    seqs = _corpus(llm, prompts or PROMPTS, max_tokens, temperature, seed)
    log.info("train-medusa: %d continuations in %.1f s", len(seqs), time.perf_counter() - t0)
    feats = _features(llm, [s for s, _ in seqs])
    log.info("train-medusa: features in %.1f s", time.perf_counter() - t0)
    W = _lm_head_weight(llm)  # [V, H], frozen
    V, H = W.shape
    held = max(1, len(seqs) // 10)
    x_train, y_train, m_train = _examples(feats[held:], seqs[held:], heads)
    x_test, y_test, m_test = _examples(feats[:held], seqs[:held], heads)
    vocab = torch.unique(torch.tensor([t for s, _ in seqs for t in s]))  # the tokens the corpus uses
    remap = torch.full((V,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(vocab.numel())
    W_train = W[vocab]  # [v, H]
    res_w = torch.zeros(heads, layers, H, H, requires_grad=True)
    res_b = torch.zeros(heads, layers, H, requires_grad=True)
    opt = torch.optim.Adam([res_w, res_b], lr=lr)

    def logits(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:  # [N, H] -> [heads, N, rows of proj]
        z = x.unsqueeze(0).expand(heads, -1, -1)
        for j in range(layers):
            z = z + F.silu(torch.baddbmm(res_b[:, j].unsqueeze(1), z, res_w[:, j].transpose(1, 2)))
        return z @ proj.T

    n = x_train.shape[0]
    y_local = remap[y_train].clamp(min=0)  # every corpus token is in the training vocabulary (the rest: masked)
    for step in range(steps):
        pick = torch.randint(0, n, (min(batch, n),))
        lg = logits(x_train[pick], W_train)  # [heads, b, v]
        y, m = y_local[pick].T, m_train[pick].T  # [heads, b]
        loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1), reduction="none")
        loss = (loss * m.reshape(-1)).sum() / m.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log.info("train-medusa: step %d/%d, loss %.3f", step + 1, steps, float(loss.detach()))
    with torch.no_grad():
        top1, top3 = [], []
        lg = logits(x_test, W)
        for i in range(heads):
            mask = m_test[:, i]
            top = lg[i][mask].topk(3, dim=-1).indices
            y = y_test[mask, i].unsqueeze(1)
            top1.append(float((top[:, :1] == y).any(1).float().mean()) if mask.any() else math.nan)
            top3.append(float((top == y).any(1).float().mean()) if mask.any() else math.nan)
    tensors = {}
    for i in range(heads):
        for j in range(layers):
            tensors[f"medusa_head.{i}.{j}.linear.weight"] = res_w[i, j].detach().clone().contiguous()
            tensors[f"medusa_head.{i}.{j}.linear.bias"] = res_b[i, j].detach().clone().contiguous()
    save_file(tensors, str(out_dir / "medusa_lm_head.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({
        "medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": model or "embedded",
        "hidden_size": H, "vocab_size": V, "tokenmill_projection": "the target's LM head"}, indent=1))
    return TrainReport(out_dir, len(seqs), n + x_test.shape[0], time.perf_counter() - t0, top1, top3)


def add_train_medusa_parser(subparsers) -> None:
    p = subparsers.add_parser("train-medusa", help="Train Medusa heads for a model on its own continuations.",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="Output folder for config.json and medusa_lm_head.safetensors.")
    p.add_argument("--model", default=None, help="Model folder or .gguf (default: the embedded model).")
    p.add_argument("--heads", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=1, help="residual blocks per head (default: %(default)s)")
    p.add_argument("--steps", type=int, default=1000, help="(default: %(default)s)")
    p.add_argument("--batch", type=int, default=256, help="positions per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="continuation per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="of the continuations; 0: greedy (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_train_medusa)


def cmd_train_medusa(args: argparse.Namespace) -> int:
    r = train_medusa(args.model, args.out, args.heads, args.layers, args.steps, args.batch, args.lr, args.max_tokens,
                     args.temperature, args.seed)
    acc = ", ".join(f"head {i}: {a:.2f}/{b:.2f}" for i, (a, b) in enumerate(zip(r.top1, r.top3)))
    print(f"wrote {r.out}: {len(r.top1)} heads from {r.sequences} continuations ({r.positions} positions) in "
          f"{r.seconds:.0f} s; held-out top-1/top-3 accuracy {acc}")
    return 0
