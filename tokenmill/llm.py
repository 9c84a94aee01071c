"""Offline batch inference with vLLM's shape: LLM(model=...).generate(prompts, SamplingParams)."""
from __future__ import annotations

import itertools
from typing import Sequence

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


class LLM:
    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory_bytes: int | None = None,
        num_gpu_blocks_override: int | None = None,
        enable_prefix_caching: bool = True,
        kv_offload_bytes: int = 0,
        kv_offload_dir: str | None = None,
        kv_offload_disk_bytes: int | None = None,
        kv_offload_min_blocks: int | None = None,
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        device: str = "cpu",
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len, seed=seed),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                num_gpu_blocks_override=num_gpu_blocks_override,
                enable_prefix_caching=enable_prefix_caching,
                kv_offload_bytes=kv_offload_bytes,
                kv_offload_dir=kv_offload_dir,
                kv_offload_disk_bytes=kv_offload_disk_bytes,
                kv_offload_min_blocks=kv_offload_min_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, policy=scheduling_policy
            ),
            device=device,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]] | list[int],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params.")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities.")
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, params, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [
            tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                    chat_template=chat_template)
            for conv in conversations
        ]
        # The template already holds any BOS; encode without adding special tokens again.
        token_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
        outs = self.generate(token_ids, sampling_params, use_tqdm)
        for o, p in zip(outs, prompts):
            o.prompt = p
        return outs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]
