"""One admission path for every generation surface (completions and chat today; the Responses and Messages APIs
next): each surface parses its body and shapes its answers, and admits the work through here.

Admission comes in three steps, because a surface has its own cheap checks in between (and must refuse those
before it renders or tokenizes anything):

1. `admit(...)`: who asks (the tenant the middleware found), which served model or adapter, and the latency
   targets (SLO) the request runs with. A wrong model (404) or SLO (400) is refused first, before any other
   check of the body.
2. `Admission.take_sequences(n)`: once the surface knows the work asked for (prompts x n), the rest of the
   tenant's sequence slots (a 429 before a prompt is tokenized).
3. `await Admission.submit(ids, texts, params)`: with the prompts' token ids and SamplingParams, the engine's
   capacity (503), the tenant's token reservation (429), the engine requests added, and the request marked
   for metering.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tokenmill.core.request import RequestSLO
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.serve.errors import bad_request
from tokenmill.serve.generation import Submission
from tokenmill.serve.protocol import SLOField
from tokenmill.serve.state import ServerState
from tokenmill.serve.tenants.isolation import cache_salt_for
from tokenmill.serve.tenants.keys import Tenant, priority_for, request_slo, slo_for, tenant_of
from tokenmill.serve.tenants.limits import admit_sequences, reserve_for, worst_case_tokens
from tokenmill.serve.tenants.usage import mark


@dataclass
class Admission:
    """One HTTP request admitted so far: its caller, model and SLO resolved; sequences and tokens still to take."""

    state: ServerState
    scope: dict[str, Any]  # the ASGI scope, where the middleware reads back what was taken and what to meter
    tenant: Tenant | None
    model: str  # the served name the request runs under: echoed in answers, metered
    lora: LoRARequest | None
    slo: RequestSLO | None
    priority: int  # as the request asked; the tenant's class is applied at submission
    cache_salt: str | None  # as the request asked; the tenant's cache group is mixed in at submission
    arrival_time: float | None  # time.monotonic() when the HTTP request arrived (None: now)

    def take_sequences(self, sequences: int) -> None:
        """Per-tenant limits count sequences, the work asked for (every prompt x n): take them, or raise the 429."""
        admit_sequences(self.scope, self.state.limiter, self.tenant, sequences)

    async def submit(self, prompts: list[list[int]], texts: list[str | None],
                     params: list[SamplingParams]) -> Submission:
        """Run the request: one engine request per prompt (`texts`: each prompt's text, None for token ids).
        Refuses (503) when the engine is full and (429) when the tenant's token budgets cannot hold the worst
        case; from the start on, the request is metered (one refused before it ran carries no tokens)."""
        state = self.state
        state.check_capacity()
        sub = Submission(state.engine, prompts, texts, params, priority_for(self.tenant, self.priority),
                         self.arrival_time, self.lora, self.slo, cache_salt_for(self.tenant, self.cache_salt))
        reserve_for(self.scope, state.limiter, self.tenant,
                    worst_case_tokens(prompts, params, state.engine.max_model_len),
                    lambda: sub.usage().total_tokens)
        await sub.start()
        mark(self.scope, self.model, sub)
        return sub


def admit(state: ServerState, raw: Request, *, model: str | None, slo: SLOField | None, priority: int = 0,
          cache_salt: str | None = None, arrival_time: float | None = None) -> Admission:
    """The first step of admission, before any other check of the body: the tenant, the served model or adapter
    it may use (404 otherwise) and its SLO (400 for a target the server cannot meet)."""
    tenant = tenant_of(raw.scope)
    served, lora = state.resolve_model(model, tenant, raw.scope)
    try:
        targets = slo_for(tenant, request_slo(slo, state.settings.min_slo_ttft_ms))
    except ValueError as e:
        raise bad_request(str(e), "slo") from None
    return Admission(state, raw.scope, tenant, served, lora, targets, priority, cache_salt, arrival_time)
