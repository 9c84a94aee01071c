"""Tenants at the router: with `--api-keys-file`, the router (not each backend) authenticates tenants, enforces
their limits and meters their usage, so one tenant's limits hold over every backend behind it (the counts live
in the router process; metering goes to the router's `--usage-db`).

What each request passes to a backend: the tenant's priority class and SLO as the request's `priority` and `slo`
fields (so the backends' `priority` / `slo` scheduling policies act on them), and the router's own
`--backend-api-key` instead of the tenant's key. Usage comes from the backends' answers: a non-streamed
response's `usage`; for a stream the router asks for the final usage chunk (`stream_options.include_usage`) and
passes it on only when the client asked for it. A stream cut short before its usage chunk (the client left, the
backend broke) is metered with its prompts as the router reserved them (exact for token ids or with --tokenizer,
else their upper bound) and the completion tokens its chunks carried: a chunk's logprobs count them exactly, else
one a chunk with text (tokenmill sends at least one token a chunk: a lower bound). A request no backend answered
with success (refused, 4xx, 5xx) used nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator

from tokenmill.serve.errors import APIError
from tokenmill.core.request import RequestSLO
from tokenmill.serve.tenants.isolation import cache_salt_for
from tokenmill.serve.tenants.keys import Tenant, priority_for, slo_for


@dataclass
class StreamMeter:
    """What a backend's answer says the request used, filled as it passes through the router."""

    prompt_reserved: int = 0  # the prompts' tokens as reserved: what a stream cut short is charged for them
    echo: bool = False  # a choice's first chunk then carries the prompt (its tokens are not the completion's)
    served: bool = False  # a backend answered with success: only then is anything charged
    prompt_tokens: int | None = None  # from the backend's usage, once seen
    cached_tokens: int = 0
    completion_tokens: int = 0
    seen: dict[int, int] = field(default_factory=dict)  # choice index -> completion tokens its chunks carried
    has_usage: bool = False

    def counts(self) -> tuple[int, int, int]:
        if self.has_usage:
            return self.prompt_tokens or 0, self.cached_tokens, self.completion_tokens
        if not self.served:
            return 0, 0, 0
        return self.prompt_reserved, 0, sum(self.seen.values())

    def total(self) -> int:
        prompt, _, completion = self.counts()
        return prompt + completion

    def take_usage(self, usage: dict) -> None:
        self.has_usage = True
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens = int(details.get("cached_tokens") or 0)

    def read_json(self, content: bytes) -> None:
        try:
            usage = json.loads(content).get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(usage, dict):
            self.take_usage(usage)

    def take_choice(self, choice: dict) -> None:
        """Count the completion tokens one streamed choice carries."""
        index = choice.get("index", 0)
        if not isinstance(index, int):
            return
        first = index not in self.seen
        self.seen.setdefault(index, 0)
        if first and self.echo:
            return  # the echoed prompt, with perhaps a token we cannot tell apart: none counted (a lower bound)
        logprobs = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
        tokens = logprobs.get("tokens", logprobs.get("content"))  # completions / chat
        if isinstance(tokens, list):
            self.seen[index] += len(tokens)
            return
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else choice
        if any(delta.get(k) for k in ("text", "content", "reasoning_content", "reasoning", "tool_calls")):
            self.seen[index] += 1


def apply_tenant(body: dict, tenant: Tenant) -> None:
    """Check the tenant may use the body's model and write its priority class and SLO into the body (what the
    backends' schedulers read). APIError for a model the tenant may not use (404, as for one that does not
    exist) or a bad `slo`."""
    model = body.get("model")
    if not isinstance(model, str) or not tenant.may_use(model):
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    priority = body.get("priority", 0)
    body["priority"] = priority_for(tenant, priority if isinstance(priority, int) else 0)
    asked = body.get("slo") if isinstance(body.get("slo"), dict) else {}
    try:
        slo = slo_for(tenant, RequestSLO(asked.get("ttft_ms"), asked.get("tpot_ms")))
    except ValueError as e:
        raise APIError(400, str(e), "slo") from None
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= 256):
        raise APIError(400, "cache_salt must be a string of 1 to 256 characters.", "cache_salt")
    # The backends see the router's key, not the tenant's: the tenant's prefix-cache salt travels in the body.
    body["cache_salt"] = cache_salt_for(tenant, salt)
    if slo is None:
        body.pop("slo", None)
    else:
        body["slo"] = {k: v for k, v in (("ttft_ms", slo.ttft_ms), ("tpot_ms", slo.tpot_ms)) if v is not None}


def ask_for_usage(body: dict) -> bool:
    """Make a streamed request end with its usage chunk (what the router meters). Returns whether the client
    asked for that chunk itself (else the router keeps it from the client); True for a non-streamed request."""
    if not body.get("stream"):
        return True
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    body["stream_options"] = {**options, "include_usage": True}
    return bool(options.get("include_usage"))


async def metered_stream(chunks: AsyncIterator[bytes], meter: StreamMeter, pass_usage: bool) -> AsyncIterator[bytes]:
    """Pass an SSE stream through event by event, reading the usage chunk (dropped unless `pass_usage`) and
    counting the completion tokens of the content chunks."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if _keep(event, meter, pass_usage):
                yield event + b"\n\n"
    if buf:
        yield buf


def _keep(event: bytes, meter: StreamMeter, pass_usage: bool) -> bool:
    if not event.startswith(b"data: {"):
        return True
    try:
        data = json.loads(event[6:])
    except ValueError:
        return True
    choices = data.get("choices")
    if isinstance(data.get("usage"), dict) and not choices:  # the final usage-only chunk
        meter.take_usage(data["usage"])
        return pass_usage
    # A content chunk's usage (vLLM's continuous_usage_stats) is one choice's so far, not the request's: not read.
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                meter.take_choice(choice)
    return True
