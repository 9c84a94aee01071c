"""Per-request sampling parameters (vLLM's names and defaults)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

# Every integer the sampler turns into a tensor fits in int64; seeds are taken modulo 2**63 at admission.
INT64_MAX = 2**63 - 1


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `structured_outputs`): set exactly one of the first six fields.
    Compiled by llguidance in the engine core (tokenmill/structured_output)."""

    json: str | dict | None = None  # a JSON schema (dict or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF/EBNF
    json_object: bool | None = None  # any JSON object
    structural_tag: str | dict | None = None  # {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
    # JSON compile options: no whitespace outside strings (vLLM's disable_any_whitespace).
    disable_any_whitespace: bool = False
    # Apply the constraint only after the output contains these tokens (the end of a reasoning section);
    # empty: from the first token. Set by the server's reasoning parser.
    start_after_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object "
                             f"or structural_tag; got {kinds or 'none'}.")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        self.start_after_token_ids = tuple(int(t) for t in self.start_after_token_ids)

    def constraints(self) -> dict[str, Any]:
        """The six constraint fields by name (set or not)."""
        return {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": self.json_object, "structural_tag": self.structural_tag}

    def kinds(self) -> list[str]:
        return [k for k, v in self.constraints().items() if v not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    @property
    def value(self) -> Any:
        """The constraint as given (the field `kind` names)."""
        return self.constraints()[self.kind]

    def spec(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints give equal keys (the compiled-grammar cache's key)."""
        kind, value = self.kind, self.value
        if kind == "json_object":
            value = ""
        else:
            if isinstance(value, str) and kind in ("json", "structural_tag"):
                try:  # the same schema as text or as a dict, spaced or not, is one key
                    value = json.loads(value)
                except ValueError:
                    pass  # not JSON: the grammar check reports it
            if not isinstance(value, str):
                value = json.dumps(value, separators=(",", ":"))  # key order kept: it is the output order
        if self.disable_any_whitespace and kind in ("json", "json_object"):
            kind += ":compact"
        return kind, value


POOLING_TYPES = ("last", "mean")


@dataclass
class PoolingParams:
    """What makes a request an embedding request (`LLM.embed`, POST /v1/embeddings): its prompt's final hidden
    states (after the final norm) are pooled into one vector, the request's output instead of tokens. It runs
    through the same scheduler as any prompt (chunked prefill included) and ends after its last prompt chunk,
    sampling nothing."""

    pooling: str | None = None  # "last" (the last prompt token's state) | "mean" (every one's); None: --pooling
    normalize: bool = True  # L2-normalised, as OpenAI's embeddings are
    dimensions: int | None = None  # Matryoshka: keep the first `dimensions` values (renormalised when normalize)

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}.")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}.")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}.")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Set: an embedding request (see PoolingParams); nothing is sampled, so the fields above mostly do not apply.
    pooling: PoolingParams | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.pooling, dict):
            self.pooling = PoolingParams(**self.pooling)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias and not all(type(k) is int for k in self.logit_bias):
            try:  # JSON gives the ids as strings; int keys keep their dict, so replace() shares it, never copies
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {list(self.logit_bias)[:3]!r}.") from None
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise ValueError(f"{param} {msg}")

        integers = {"n": self.n, "top_k": self.top_k, "min_tokens": self.min_tokens, "max_tokens": self.max_tokens,
                    "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs, "seed": self.seed}
        for name, value in integers.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                bad(name, f"must be an integer, got {value!r}.")
            if value is not None and not -INT64_MAX - 1 <= value <= INT64_MAX:
                bad(name, f"must fit in a signed 64-bit integer, got {value}.")
        numbers = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                   "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                   "frequency_penalty": self.frequency_penalty}
        for name, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, f"must be a finite number, got {value!r}.")
        if self.n < 1:
            bad("n", f"must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad("top_k", f"must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs}.")
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            bad("stop", "must be non-empty strings.")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be integers.")
        if self.logit_bias:
            for tok, value in self.logit_bias.items():  # keys: ints since __post_init__
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    bad("logit_bias", f"values must be finite numbers, got {value!r} for token {tok}.")
        if self.pooling is not None:  # one vector per prompt: nothing to sample, score or constrain
            if self.n != 1:
                bad("n", f"must be 1 for an embedding request, got {self.n}.")
            for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs),
                                ("structured_outputs", self.structured_outputs)):
                if value is not None:
                    bad(name, "is not supported for an embedding request.")
