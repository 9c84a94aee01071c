"""Offline batch inference with vLLM's shape: LLM(model=...).generate(prompts, SamplingParams), .embed(prompts)."""
from __future__ import annotations

import itertools
import numbers
from typing import Any, Sequence, Union

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine_args import EngineArgs
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput
from tokenmill.sampling_params import PoolingParams, SamplingParams

# vLLM's prompt shapes: text, token ids, {"prompt": text} (TextPrompt), {"prompt_token_ids": ids} (TokensPrompt).
PromptType = Union[str, list[int], dict]


def parse_prompts(prompts: PromptType | Sequence[PromptType]) -> list[tuple[str | None, list[int] | None]]:
    """One prompt or a list of them (shapes may mix) -> [(text, None) or (None, token ids)]."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], numbers.Integral)):
        prompts = [prompts]
    return [_parse_prompt(p, i) for i, p in enumerate(prompts)]


def _parse_prompt(prompt: PromptType, index: int) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(f"prompt {index}: unsupported key(s) {sorted(unknown)}; "
                             "give {'prompt': text} or {'prompt_token_ids': [ids]}.")
        if len(prompt) != 1:
            raise ValueError(f"prompt {index}: a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids', "
                             f"got {sorted(prompt) or 'neither'}.")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"prompt {index}: 'prompt' must be a string, got {type(prompt['prompt']).__name__}.")
            return prompt["prompt"], None
        return None, _token_ids(prompt["prompt_token_ids"], index)
    if isinstance(prompt, (list, tuple)):
        return None, _token_ids(prompt, index)
    raise ValueError(f"prompt {index}: expected text, a list of token ids, {{'prompt': text}} or "
                     f"{{'prompt_token_ids': [ids]}}; got {type(prompt).__name__}.")


def _token_ids(ids: Any, index: int) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"prompt {index}: token ids must be a non-empty list of ints, got {ids!r:.80}.")
    bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
    if bad:
        raise ValueError(f"prompt {index}: token ids must be ints, got {bad[0]!r} ({type(bad[0]).__name__}).")
    return [int(t) for t in ids]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs` are EngineArgs fields (tokenmill/engine_args.py), e.g. max_model_len=2048, block_size=16."""
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.engine = LLMEngine(self.engine_args.create_engine_config())
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ---- lifecycle: worker processes (tensor/pipeline parallel) end with the LLM ---------------------
    def close(self) -> None:
        """Stop the engine and its worker processes (also on `with LLM(...)` exit); the LLM cannot generate
        afterwards. Without it, the workers stop when the engine is garbage-collected or the interpreter exits
        (the executor's finalizer): an engine taken out of an LLM (`LLM(...).engine`) keeps them."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one per prompt (None: the base model); needs
        LLM(..., enable_lora=True). `cache_salt` (vLLM's): prompts share prefix-cache blocks only with requests of
        the same salt."""
        prompts = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params.")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities.")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora_requests.")
        ids = []
        try:
            for i, ((text, token_ids), params) in enumerate(zip(prompts, sampling_params)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, text, params, prompt_token_ids=token_ids,
                                        priority=priority[i] if priority else 0, lora_request=loras[i],
                                        cache_salt=cache_salt)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        cache_salt: str | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.embedding`): the final hidden state (after the final norm) of the prompt's
        last token, or the mean over its tokens (LLM(..., pooling="mean"), or PoolingParams.pooling), L2-normalised
        unless PoolingParams(normalize=False), truncated to PoolingParams.dimensions. The prompts run through the
        same scheduler as generation. Raises EngineError if one failed in the engine."""
        from tokenmill.engine.output import EngineError

        prompts = parse_prompts(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        if isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(pooling_params)} pooling_params.")
        params = [SamplingParams(max_tokens=1, pooling=p) for p in pooling_params]
        outs = self.generate([{"prompt": t} if t is not None else {"prompt_token_ids": ids} for t, ids in prompts],
                             params, use_tqdm, lora_request=lora_request, cache_salt=cache_salt)
        for o in outs:
            error = o.extra.get("error")
            if error is not None:
                raise EngineError(f"embedding request {o.request_id} failed: {error['message']}", 500, error["code"])
        return outs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
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
        outs = self.generate(token_ids, sampling_params, use_tqdm, lora_request=lora_request)
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
