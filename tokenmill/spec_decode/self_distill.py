"""Self-distillation, the recipe `tokenmill train-medusa`, `train-eagle` and `train-dflash` share (Medusa-2's: no
dataset to download, and a head learns what this model will say, which is what speculation needs):

1. Corpus: the model continues the prompts shipped here (`PROMPTS`: six kinds of instruction over forty topics)
   through its chat template, at --temperature (greedy by default: the heads then learn what greedy decoding
   will emit).
2. Features: one forward per sequence over prompt + continuation with the engine's own model and attention
   backend, keeping the final hidden state (after the last norm) at every position.
3. The target's LM head, frozen, read back as a float matrix; training losses use its rows for the tokens the
   corpus uses (a few thousand of SmolLM2's 49k: the softmax over the whole vocabulary would cost 15x more per
   step on the CPU, and the heads are meant for what this model says), the held-out reports the full vocabulary.
4. `fit`: Adam-style steps over random batches of examples, logged every so often.

Each trainer (medusa_train.py, eagle_train.py, dflash_train.py) supplies its head, its loss and its report, and
writes its folder with head_folder.write_folder.
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

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

Sequence = tuple[list[int], int]  # prompt + continuation token ids, prompt length


def corpus(llm, prompts: list[str], max_tokens: int, temperature: float, seed: int) -> list[Sequence]:
    """(prompt + continuation token ids, prompt length) per prompt, sampled from the model itself."""
    from tokenmill import SamplingParams

    tok = llm.get_tokenizer()
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    return [(list(i) + list(o.outputs[0].token_ids), len(i)) for i, o in zip(ids, outs)]


@torch.inference_mode()
def features(llm, seqs: list[list[int]], name: str) -> list[torch.Tensor]:
    """The model's final hidden states at every position of each sequence (one forward each, through the engine's
    runner and attention backend, into the then idle KV pool)."""
    from tokenmill.executor.input_batch import pack_layout

    runner = llm.engine.core.executor.worker.runner
    if len(runner.kv_groups) > 1:
        raise ValueError(f"{name}: models with several KV cache groups are not supported (run with "
                         "--disable-hybrid-kv-cache-manager).")
    bs, out = runner.block_size, []
    for seq in seqs:
        nb = -(-len(seq) // bs)
        if nb + 1 > runner.num_blocks:
            raise ValueError(f"{name}: a sequence of {len(seq)} tokens needs more KV blocks than the pool has")
        layout, positions = pack_layout(np.array([0]), np.array([len(seq)]), [list(range(1, nb + 1))], bs)
        meta = runner.backend.build_metadata(layout)
        hidden = runner.model(torch.tensor(seq, device=runner.device), torch.from_numpy(positions).to(runner.device),
                              meta)
        out.append(hidden.float().cpu().clone())
    return out


@torch.inference_mode()
def embed(llm, ids: torch.Tensor) -> torch.Tensor:
    """The target's embeddings of token ids, as float32 on the CPU (train-eagle's and train-dflash's inputs)."""
    runner = llm.engine.core.executor.worker.runner
    return runner.model.embed_tokens(ids.to(runner.device)).float().cpu().clone()


def lm_head_weight(llm) -> torch.Tensor:
    """The target's LM head as a float [V, H] matrix (read back through its own forward: any storage format)."""
    runner = llm.engine.core.executor.worker.runner
    model = runner.model
    with torch.inference_mode():
        w = model.lm_head.compute_logits(torch.eye(model.spec.hidden_size, dtype=model.compute_dtype,
                                                   device=runner.device))
    return w.float().cpu().T.contiguous().clone()


@dataclass
class Distillation:
    """A target's continuations and their features, with its frozen LM head (whole and restricted to the tokens
    the corpus uses)."""

    llm: Any  # tokenmill.LLM, the target
    seqs: list[Sequence]
    feats: list[torch.Tensor]  # [len(seq), H] per sequence
    W: torch.Tensor  # [V, H]
    t0: float  # when training began (perf_counter)
    vocab: torch.Tensor = field(init=False)  # the token ids the corpus uses
    remap: torch.Tensor = field(init=False)  # [V]: index into vocab, -1 for the tokens it does not use
    W_train: torch.Tensor = field(init=False)  # [len(vocab), H]: W's rows of vocab

    def __post_init__(self) -> None:
        self.vocab = torch.unique(torch.tensor([t for s, _ in self.seqs for t in s]))
        self.remap = torch.full((self.W.shape[0],), -1, dtype=torch.long)
        self.remap[self.vocab] = torch.arange(self.vocab.numel())
        self.W_train = self.W[self.vocab]

    @property
    def held(self) -> int:
        """The first `held` sequences are held out for the report (a tenth, at least one)."""
        return max(1, len(self.seqs) // 10)

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> rows of W_train (every corpus token has one; the rest, masked by callers, 0)."""
        return self.remap[ids].clamp(min=0)

    def seconds(self) -> float:
        return time.perf_counter() - self.t0


def distill(name: str, model: str | None, prompts: list[str] | None, max_tokens: int, temperature: float,
            seed: int, **engine_kw) -> Distillation:
    """Load the target (one process, no prefix caching: every forward computes every position), sample its
    continuations of `prompts` (default PROMPTS) and compute their features."""
    from tokenmill import LLM

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    llm = LLM(model, enable_prefix_caching=False, distributed_executor_backend="uni", **engine_kw)
    seqs = corpus(llm, prompts or PROMPTS, max_tokens, temperature, seed)
    feats = features(llm, [s for s, _ in seqs], name)
    log.info("%s: %d continuations and their features in %.1f s", name, len(seqs), time.perf_counter() - t0)
    return Distillation(llm, seqs, feats, lm_head_weight(llm), t0)


def targets_ahead(feats: list[torch.Tensor], seqs: list[Sequence], k: int):
    """(hidden [N, H], last token [N], targets [N, k], mask [N, k]) over the continuations' positions p, from the
    prompt's last token (it predicts the first output): the hidden state at p, the token at p + 1 it produced,
    and the k tokens after that (p + 2 .. p + k + 1; masked past the sequence's end)."""
    hs, last, ys, ms = [], [], [], []
    for h, (seq, plen) in zip(feats, seqs):
        L = len(seq)
        pos = torch.arange(plen - 1, L - 2)
        if pos.numel() == 0:
            continue
        tok = torch.tensor(seq)
        idx = pos.unsqueeze(1) + 2 + torch.arange(k).unsqueeze(0)  # [n, k]
        ok = idx < L
        hs.append(h[pos])
        last.append(tok[pos + 1])
        ys.append(torch.where(ok, tok[idx.clamp(max=L - 1)], 0))
        ms.append(ok)
    return torch.cat(hs), torch.cat(last), torch.cat(ys), torch.cat(ms)


def fit(name: str, opt: torch.optim.Optimizer, steps: int, batch: int, n: int,
        loss: Callable[[torch.Tensor], dict[str, torch.Tensor]], every: int = 100,
        show: str = "loss {loss:.3f}") -> None:
    """`steps` steps of `opt`, each on a random batch of `batch` of the n examples (their indices [b] go to
    `loss`, which returns its named parts, "loss" the one minimised); `show` formats the parts into the log line
    written every `every` steps and at the last (none when every is 0)."""
    for step in range(steps):
        pick = torch.randint(0, n, (min(batch, n),))
        parts = loss(pick)
        opt.zero_grad()
        parts["loss"].backward()
        opt.step()
        if every and (step % every == 0 or step == steps - 1):
            values = {k: float(v.detach()) for k, v in parts.items()}
            log.info("%s: step %d/%d, %s", name, step + 1, steps, show.format(**values))


def add_trainer_parser(subparsers, name: str, help: str, doc: str, out: str,
                       cmd: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """A trainer's subcommand with the output folder and --model; the trainer adds its head's options, then
    add_loop_args."""
    p = subparsers.add_parser(name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help=f"Output folder for config.json and {out}.")
    p.add_argument("--model", default=None, help="Model folder or .gguf (default: the embedded model).")
    p.set_defaults(func=cmd)
    return p


def add_loop_args(p: argparse.ArgumentParser, steps: int, batch: int, lr: float, per: str = "positions") -> None:
    """The options every trainer has: its loop's, and the corpus's."""
    p.add_argument("--steps", type=int, default=steps, help="(default: %(default)s)")
    p.add_argument("--batch", type=int, default=batch, help=f"{per} per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=lr, help="(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="continuation per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="of the continuations; 0: greedy (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
