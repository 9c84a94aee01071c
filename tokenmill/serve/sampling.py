"""Request fields -> SamplingParams, with the checks that need the model (vocabulary, context length)."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.serve.errors import APIError, bad_request, context_length_error, from_value_error
from tokenmill.serve.protocol import ChatCompletionRequest, CompletionRequest

MAX_LOGIT_BIAS = 100.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left


@dataclass
class Limits:
    """What one request may ask for (serve flags; docs/server.md lists them). 0 for a budget: derived from
    max_model_len."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int = 20
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_length: int = 256  # characters
    max_request_tokens: int = 0  # see request_tokens(); 0: 8 x max_model_len
    max_input_chars: int = 0  # characters of prompt text to tokenize; 0: 32 x max_model_len
    # Lists the sampler reads at every step of every sequence: bounded so that one request's step cost stays
    # a small fraction of the vocabulary's (OpenAI allows 300 logit_bias entries).
    max_logit_bias: int = 1024  # entries
    max_stop_token_ids: int = 1024
    max_prompts: int = 1024  # prompts in one completions request (each is an engine request per sequence)

    def __post_init__(self) -> None:
        self.max_request_tokens = self.max_request_tokens or 8 * self.max_model_len
        self.max_input_chars = self.max_input_chars or 32 * self.max_model_len


def check_input_chars(num_chars: int, limits: Limits, param: str) -> None:
    """Before tokenizing: text that could never fit the context is refused unread."""
    if num_chars > limits.max_input_chars:
        raise bad_request(f"{param} is {num_chars} characters; this server tokenizes at most "
                          f"{limits.max_input_chars} characters per request (--max-input-chars).", param)


def check_count(count: int, limit: int, param: str, flag: str, what: str) -> None:
    if count > limit:
        raise bad_request(f"{param} may hold at most {limit} {what} on this server ({flag}), got {count}.", param)


def request_tokens(num_prompt: int, n: int, max_tokens: int, prompt_logprobs: bool) -> int:
    """One prompt's share of a request's work: n x max_tokens generated, plus the prompt once (the n sequences
    share its KV through the prefix cache), or n times with prompt logprobs (echo + logprobs): the engine computes
    them once (the first sequence), but the answer carries them in each of the n choices, n x prompt x
    (logprobs + 1) entries to build and send."""
    return num_prompt * (n if prompt_logprobs else 1) + n * max_tokens


def check_request_budget(prompt_lens: list[int], params: SamplingParams, limits: Limits) -> None:
    """One request's total work (request_tokens over all its prompts) against --max-request-tokens."""
    with_prompt_lps = params.prompt_logprobs is not None
    total = sum(request_tokens(p, params.n, params.max_tokens or limits.max_model_len - p, with_prompt_lps)
                for p in prompt_lens)  # max_tokens None: up to the context
    if total > limits.max_request_tokens:
        what = ("n x prompt tokens (echo with logprobs repeats the prompt in each choice)" if with_prompt_lps
                else "prompt tokens") + " + n x max_tokens" + (" over all prompts" if len(prompt_lens) > 1 else "")
        fix = "Lower n or max_tokens" + (", or leave out echo or logprobs" if with_prompt_lps else "")
        raise bad_request(f"this request asks for {total} tokens ({what}); this server allows at most "
                          f"{limits.max_request_tokens} per request (--max-request-tokens). {fix}.", "max_tokens")


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param} contains token id {bad}, outside the vocabulary [0, {vocab_size}).", param)


def _logit_bias(raw: dict[str, float] | None, limits: Limits) -> dict[int, float] | None:
    if not raw:
        return None
    out = {}
    for key, value in raw.items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
        if not 0 <= tok < limits.vocab_size:
            raise bad_request(f"logit_bias token id {tok} is outside the vocabulary [0, {limits.vocab_size}).",
                              "logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value} for token {tok}.", "logit_bias")
        out[tok] = float(value)
    return out


def check_context(num_prompt: int, max_tokens: int | None, limits: Limits, chat: bool) -> None:
    if num_prompt >= limits.max_model_len:
        raise context_length_error(limits.max_model_len, num_prompt, None, chat)
    if max_tokens is not None and max_tokens >= 1 and num_prompt + max_tokens > limits.max_model_len:
        raise context_length_error(limits.max_model_len, num_prompt, max_tokens, chat)


def build_sampling_params(req: CompletionRequest | ChatCompletionRequest, prompt_lens: list[int], limits: Limits,
                          structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """The one SamplingParams every prompt of the request shares (built once: a batch of prompts never copies its
    logit_bias or stop lists), after every check against the limits, the context and the request budget."""
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
    if req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}.", "n")
    if req.n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n} on this server (--max-n), got {req.n}.", "n")
    check_lists(req, limits)
    if logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
        raise bad_request(f"{lp_param} must be in [0, {limits.max_logprobs}], got {logprobs}.", lp_param)
    if req.stop_token_ids:
        _check_ids(req.stop_token_ids, limits.vocab_size, "stop_token_ids")
    if max_tokens is None:
        max_tokens = _default_max_tokens(prompt_lens, req.n, limits)
    for num_prompt in prompt_lens:
        check_context(num_prompt, max_tokens, limits, chat)

    fields = set(type(req).model_fields)
    try:
        params = SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed,  # int64; the processor takes it modulo 2**63 (negative seeds are valid for OpenAI)
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(req.logit_bias, limits),
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_outputs=structured,
        )
    except ValueError as e:
        raise from_value_error(e, fields) from None
    check_request_budget(prompt_lens, params, limits)
    return params


def _default_max_tokens(prompt_lens: list[int], n: int, limits: Limits) -> int | None:
    """No max_tokens given (chat: up to the context). When the context's room would break the request budget,
    each sequence gets its share of the budget instead; else None (the room left, per prompt)."""
    room = sum(limits.max_model_len - p for p in prompt_lens)
    if sum(prompt_lens) + n * room <= limits.max_request_tokens:
        return None
    return max(1, (limits.max_request_tokens - sum(prompt_lens)) // (n * len(prompt_lens)))


def check_lists(req: CompletionRequest | ChatCompletionRequest, limits: Limits) -> None:
    """The lengths of the lists a request's sampling carries: cheap, so checked before anything is tokenized."""
    _check_stops(req.stop, limits)
    check_count(len(req.stop_token_ids or ()), limits.max_stop_token_ids, "stop_token_ids", "--max-stop-token-ids",
                "ids")
    check_count(len(req.logit_bias or ()), limits.max_logit_bias, "logit_bias", "--max-logit-bias", "entries")


def _check_stops(stop: str | list[str] | None, limits: Limits) -> None:
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"stop may hold at most {limits.max_stop_strings} strings on this server "
                          f"(--max-stop-strings), got {len(stops)}.", "stop")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_string_length:
        raise bad_request(f"each stop string may be at most {limits.max_stop_string_length} characters on this "
                          f"server (--max-stop-string-length), got one of {longest}.", "stop")


def check_prompt_ids(ids: list[int], limits: Limits, param: str) -> None:
    if not ids:
        raise bad_request(f"{param} must not be empty.", param)
    _check_ids(ids, limits.vocab_size, param)


__all__ = ["APIError", "Limits", "build_sampling_params", "check_context", "check_count", "check_input_chars",
           "check_lists", "check_prompt_ids", "check_request_budget"]
