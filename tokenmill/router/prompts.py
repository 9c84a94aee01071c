"""A request body's prompts as token ids, the way a tokenmill backend would tokenize them, so the router can name
their blocks and reserve what a request may cost. Token-id prompts need no tokenizer; text needs one
(--tokenizer), else no ids (None) and, for accounting, bounds on the count.

Accounting without a tokenizer: a text prompt holds at least one token and at most one per UTF-8 byte (byte-level
BPE and byte-fallback vocabularies never use more) plus a few special tokens; a chat prompt at most its messages'
JSON bytes plus an allowance for the template's own text. The worst case of a request is taken over those bounds,
so a reservation covers what the backend may use; what it really used comes from the backend's `usage`."""
from __future__ import annotations

import json
from typing import Any

DEFAULT_MAX_TOKENS = 256  # output reserved per sequence when max_tokens is unset and no backend said max_model_len
_SPECIAL_TOKENS = 4  # BOS/EOS and a leading-space marker a tokenizer may add to a text prompt
_CHAT_TEMPLATE_TOKENS = 64  # role headers, a default system prompt, the tools' preamble of a chat template


class PromptTokenizer:
    def __init__(self, path: str | None) -> None:
        self.tokenizer = None
        if path:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(path)

    def token_ids(self, body: dict[str, Any]) -> list[int] | None:
        """The first prompt's ids (a batch of prompts routes as one request), or None if unknown."""
        if "messages" in body:
            return self._chat(body["messages"])
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and self.tokenizer is not None:
            return self.tokenizer(prompt).input_ids
        return None

    def counts(self, body: dict[str, Any]) -> list[tuple[int, int]]:
        """Each prompt's token count as (at least, at most): exact for token ids, and for text with --tokenizer
        (for chat, when its template renders the messages). Runs the tokenizer: call it off the event loop."""
        if "messages" in body:
            ids = self._chat(body["messages"])
            if ids is not None:
                return [(len(ids), len(ids))]
            size = len(json.dumps([body["messages"], body.get("tools")]).encode())
            return [(1, size + _CHAT_TEMPLATE_TOKENS)]
        return [self._count(p) for p in prompt_list(body.get("prompt"))]

    def _count(self, prompt: Any) -> tuple[int, int]:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return len(prompt), len(prompt)
        if isinstance(prompt, str) and self.tokenizer is not None:
            n = len(self.tokenizer(prompt).input_ids)
            return n, n
        size = len(prompt.encode() if isinstance(prompt, str) else json.dumps(prompt).encode())
        return 1, size + _SPECIAL_TOKENS

    def _chat(self, messages: Any) -> list[int] | None:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):  # tokenizer classes vary
            return None
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # content parts, tools...: route without cache info rather than fail
            return None
        return self.tokenizer(text, add_special_tokens=False).input_ids


def estimate_tokens(body: dict[str, Any], ids: list[int] | None) -> int:
    """Outstanding tokens this request adds to a backend: prompt (ids, else ~4 chars a token) + output."""
    if ids is not None:
        prompt = len(ids)
    elif "messages" in body:
        prompt = len(str(body["messages"])) // 4
    else:
        prompt = len(str(body.get("prompt", ""))) // 4
    return prompt + max_output_tokens(body)


def max_output_tokens(body: dict[str, Any]) -> int:
    """The output a request asks for at most: max_tokens (256 when unset) x n."""
    return int(body.get("max_completion_tokens") or body.get("max_tokens") or 256) * int(body.get("n") or 1)


def prompt_list(prompt: Any) -> list:
    """A completions `prompt` as its list of prompts: a string or one token-id list is one prompt; a list of
    strings or of token-id lists is a batch (as the backends read it)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    if isinstance(prompt, list):
        return prompt
    return [] if prompt is None else [prompt]


def sequences_per_prompt(body: dict[str, Any]) -> int:
    """The sequences each prompt runs (n, or best_of where a backend generates more and returns the best n)."""
    return max(_int(body.get("n")) or 1, _int(body.get("best_of")) or 1)


def prompt_count(body: dict[str, Any]) -> int:
    return 1 if "messages" in body else len(prompt_list(body.get("prompt")))


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens")
    return _int(body.get("max_tokens") if value is None else value)


def worst_case(counts: list[tuple[int, int]], n: int, max_tokens: int | None, max_model_len: int | None) -> int:
    """The most tokens a request may use, as `usage.total_tokens` counts them: each prompt once plus n x its
    output, capped by max_tokens and by the room max_model_len leaves after the prompt (all of that room when
    max_tokens is unset). Each prompt's count is only known within (lo, hi): take the worst over that range."""
    total = 0
    for lo, hi in counts:
        if max_model_len is None:  # no backend said: max_tokens, or the default, and the overage charged after
            total += hi + n * (DEFAULT_MAX_TOKENS if max_tokens is None else max(max_tokens, 0))
            continue
        hi = max(lo, min(hi, max_model_len))  # a longer prompt is refused by the backend: it uses nothing more
        cap = max_model_len if max_tokens is None else max(max_tokens, 0)

        def used(p: int) -> int:
            return p + n * max(0, min(cap, max_model_len - p))

        # used() rises until the prompt leaves just `cap` of room, then falls: its maximum is at an end or there.
        total += max(used(lo), used(hi), used(min(max(max_model_len - cap, lo), hi)))
    return total


def reserved_prompt(counts: list[tuple[int, int]], max_model_len: int | None) -> int:
    """The prompts' tokens at most (what a stream cut short before its usage is charged for them)."""
    return sum(hi if max_model_len is None else max(lo, min(hi, max_model_len)) for lo, hi in counts)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
