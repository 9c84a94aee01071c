"""Incremental detokenization with stop-string detection, one instance per request.

Each engine step hands the newly sampled token ids of a request to `IncrementalDetokenizer.update`,
which decodes only those ids (plus a few ids of context), appends the text to the request's output
and checks whether a stop string has just been completed. `get_delta` then gives the text to stream,
holding back anything that might still turn out to be the start of a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.sampling_params import SamplingParams
from tokenmill.engine.stop_strings import StopMatcher

# How many prompt ids to decode ahead of the first generated token. Context matters for tokenizers
# whose decoder treats the first token specially (SentencePiece drops the leading space of the text).
PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class _TextStream(Protocol):
    def step(self, new_ids: list[int]) -> str:
        """Decode `new_ids` following everything seen so far; return the newly completed text."""
        ...


@dataclass
class _DecodeStreamText:
    """Fast path: the Rust `tokenizers.decoders.DecodeStream`, which keeps its own small id window."""

    backend: Any  # tokenizers.Tokenizer
    stream: Any  # tokenizers.decoders.DecodeStream

    def step(self, new_ids: list[int]) -> str:
        # One id at a time: given several, DecodeStream returns nothing while their text ends in an incomplete
        # UTF-8 character, and a request that finishes there (k+1 tokens of a speculative step) would lose the
        # complete characters before it too.
        if len(new_ids) == 1:
            return self.stream.step(self.backend, new_ids[0]) or ""
        return "".join(self.stream.step(self.backend, i) or "" for i in new_ids)


@dataclass
class _OffsetText:
    """Fallback for tokenizers without a Rust backend, built on `tokenizer.decode` alone.

    `ids[prefix_offset:read_offset]` is context that has already been turned into text;
    `ids[read_offset:]` are ids whose text has not been emitted yet. Decoding the context together
    with the new ids and keeping only the extra characters gets spacing right, and text ending in
    U+FFFD is held back because it is usually an incomplete multi-byte character.
    """

    tokenizer: Any
    skip_special_tokens: bool
    ids: list[int]
    prefix_offset: int
    read_offset: int

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_ids: list[int]) -> str:
        # One id at a time, for the reason _DecodeStreamText.step gives.
        return "".join(self._step_one(i) for i in new_ids)

    def _step_one(self, new_id: int) -> str:
        self.ids.append(new_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        # Forget ids that can no longer be part of the decode window, so memory stays bounded.
        del self.ids[: self.prefix_offset]
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0
        return full_text[len(prefix_text) :]


def _rust_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a fast HF tokenizer (or the tokenizer itself), else None."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    # getattr: transformers tokenizers, slow or fast; the backend's name varies by version
    if getattr(tokenizer, "is_fast", False):
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


def _prompt_context(tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
    # A prompt ending in an incomplete UTF-8 character would make the first generated ids complete
    # a character that is partly prompt; drop those bytes so the output decodes on its own.
    while context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT_CHAR):
        context.pop()
    return context


def _make_text_stream(tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> _TextStream:
    context = _prompt_context(tokenizer, prompt_token_ids, skip_special_tokens) if prompt_token_ids else []
    backend = _rust_backend(tokenizer)
    if backend is not None:
        try:
            from tokenizers.decoders import DecodeStream

            # `ids=` prefill needs a recent tokenizers; without it the offset fallback keeps the context.
            stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
            return _DecodeStreamText(backend, stream)
        except (ImportError, TypeError):
            pass
    return _OffsetText(tokenizer, skip_special_tokens, ids=context, prefix_offset=0, read_offset=len(context))


def _drop_suffix(chunks: list[str], n: int) -> None:
    """Remove the last `n` characters from a list of text chunks, in place."""
    while n > 0 and chunks:
        last = chunks.pop()
        if len(last) > n:
            chunks.append(last[: len(last) - n])
            return
        n -= len(last)


@dataclass(eq=False)
class IncrementalDetokenizer:
    """Turns a request's generated token ids into text, step by step, and detects stop strings.

    Work per `update` is proportional to the new ids and their text, not to the length of the output nor
    to the number of stop strings: the text is kept as a list of chunks and joined only when read, and stop
    strings are found by one automaton (stop_strings.py). Of several stop strings the one that ends first
    wins, however the text was split into steps.
    """

    tokenizer: Any = field(repr=False)
    prompt_token_ids: list[int] = field(repr=False)
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list, init=False)
    # The stop string that ended generation, once one has been seen.
    stop_string: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._stream = _make_text_stream(self.tokenizer, self.prompt_token_ids, self.params.skip_special_tokens)
        stops = list(self.params.stop_strings)
        self._stops = StopMatcher(stops) if stops else None
        self._chunks: list[str] = []  # all output text
        self._length = 0
        self._unsent: list[str] = []  # output text not yet returned by get_delta

    @property
    def output_text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def finished(self) -> bool:
        return self.stop_string is not None

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append newly generated ids and extend the output text.

        Returns the stop string if one now appears in the output (the text is then cut right
        before it, or right after it with include_stop_str_in_output), else None. After a stop
        string the detokenizer is finished and further updates are ignored. With check_stop=False
        (min_tokens not yet reached) the text grows but no stop string can end it.
        """
        if self.finished:
            return None
        self.token_ids.extend(new_token_ids)
        delta = self._stream.step(list(new_token_ids))
        if not delta:
            return None

        found = self._stops.feed(delta) if self._stops is not None else None
        offset = self._length
        self._chunks.append(delta)
        self._unsent.append(delta)
        self._length += len(delta)
        if found is None or not check_stop:
            return None

        start, stop = offset + found[0], found[1]
        keep = start + len(stop) if self.params.include_stop_str_in_output else start
        # The cut never reaches text already streamed: get_delta holds back every partial stop string.
        _drop_suffix(self._chunks, self._length - keep)
        _drop_suffix(self._unsent, self._length - keep)
        self._length = keep
        self.stop_string = stop
        return stop

    def get_delta(self, finished: bool = False) -> str:
        """Text produced since the last call, for streaming.

        Until the request is finished (or a stop string has ended it), the trailing characters that
        could be the beginning of a stop string are held back and returned by a later call.
        """
        unsent = "".join(self._unsent)
        hold = 0 if finished or self.finished or self._stops is None else self._stops.partial
        # `hold` cannot exceed the unsent text: a longer suffix would have been held back before.
        cut = max(0, len(unsent) - hold)
        self._unsent = [unsent[cut:]] if cut < len(unsent) else []
        return unsent[:cut]
