"""Request fields -> SamplingParams, with the checks that need the model (vocabulary, context length)."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.serve.errors import APIError, bad_request, context_length_error, from_value_error
from tokenmill.serve.protocol import ChatCompletionRequest, CompletionRequest

MAX_N = 128  # OpenAI's limit; keeps one request from flooding the scheduler
MAX_LOGIT_BIAS = 100.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
SEED_LIMIT = 2**63


@dataclass
class Limits:
    max_model_len: int
    vocab_size: int
    max_logprobs: int = 20


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise bad_request(f"{param} contains token id {bad[0]}, outside the vocabulary [0, {vocab_size}).", param)


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not raw:
        return None
    out = {}
    for key, value in raw.items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise bad_request(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab_size}).", "logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value} for token {tok}.", "logit_bias")
        out[tok] = float(value)
    return out


def check_context(num_prompt: int, max_tokens: int | None, limits: Limits, chat: bool) -> None:
    if num_prompt >= limits.max_model_len:
        raise context_length_error(limits.max_model_len, num_prompt, None, chat)
    if max_tokens is not None and max_tokens >= 1 and num_prompt + max_tokens > limits.max_model_len:
        raise context_length_error(limits.max_model_len, num_prompt, max_tokens, chat)


def build_sampling_params(req: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                          limits: Limits, structured: StructuredOutputsParams | None = None) -> SamplingParams:
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        lp_param = "top_logprobs"
        prompt_logprobs = None
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        max_param = "max_tokens"
        logprobs = req.logprobs
        lp_param = "logprobs"
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None

    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_param} must be at least 1, got {max_tokens}.", max_param)
    if req.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {req.n}.", "n")
    if logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
        raise bad_request(f"{lp_param} must be in [0, {limits.max_logprobs}], got {logprobs}.", lp_param)
    if req.seed is not None and not -SEED_LIMIT <= req.seed < SEED_LIMIT:
        raise bad_request(f"seed must fit in a signed 64-bit integer, got {req.seed}.", "seed")
    if req.stop_token_ids:
        _check_ids(req.stop_token_ids, limits.vocab_size, "stop_token_ids")
    check_context(num_prompt_tokens, max_tokens, limits, chat)

    fields = set(type(req).model_fields)
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            # Negative seeds are valid for OpenAI; torch wants non-negative ones.
            seed=None if req.seed is None else req.seed % SEED_LIMIT,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(req.logit_bias, limits.vocab_size),
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_outputs=structured,
        )
    except ValueError as e:
        raise from_value_error(e, fields) from None


def check_prompt_ids(ids: list[int], limits: Limits, param: str) -> None:
    if not ids:
        raise bad_request(f"{param} must not be empty.", param)
    _check_ids(ids, limits.vocab_size, param)


__all__ = ["APIError", "Limits", "build_sampling_params", "check_context", "check_prompt_ids"]
