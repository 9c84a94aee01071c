"""A request body's prompt as token ids, the way a tokenmill backend would tokenize it, so the router can
name its blocks. Token-id prompts need no tokenizer; text needs one (--tokenizer), else no ids (None)."""
from __future__ import annotations

from typing import Any


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

    def _chat(self, messages: Any) -> list[int] | None:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
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
