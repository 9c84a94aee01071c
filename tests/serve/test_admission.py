"""The generation surfaces admit through serve/admission.py only (issue 46): tenant, model, SLO, sequence limits,
capacity, token reservation, submission and metering are written once, so a new surface (issue 48) cannot
drift from them. Behaviour is covered by the server, tenant and usage tests; this pins the structure."""
from __future__ import annotations

import inspect

import pytest

from tokenmill.serve import chat_completions, completions

# What only serve/admission.py may call: a surface that calls one of these admits by a copy.
_ADMISSION_STEPS = ("tenant_of(", "resolve_model(", "slo_for(", "admit_sequences(", "check_capacity(",
                    "Submission(", "reserve_for(", "worst_case_tokens(", ".start()", "mark(")


@pytest.mark.parametrize("surface", [completions, chat_completions], ids=lambda m: m.__name__)
def test_surfaces_admit_through_the_one_path(surface):
    source = inspect.getsource(surface)
    assert "admit(state, raw" in source
    assert ".submit(" in source
    copied = [step for step in _ADMISSION_STEPS if step in source]
    assert not copied, f"{surface.__name__} admits by itself: {copied}"
