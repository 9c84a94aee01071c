"""Running one request in the terminal: its text streamed as it is produced, Ctrl-C stopping it (generate, chat)."""
from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine


@dataclass
class StreamResult:
    texts: list[str]
    num_tokens: int
    seconds: float
    aborted: bool = False

    def stats_line(self) -> str:
        rate = self.num_tokens / self.seconds if self.seconds > 0 else 0.0
        return f"[{self.num_tokens} tokens in {self.seconds:.2f} s, {rate:.1f} tok/s]"


_request_ids = itertools.count()


def stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams,
           write: Callable[[str], None] | None = None) -> StreamResult:
    """Run one request to completion, passing its first sequence's text to `write` as it is produced.

    Ctrl-C aborts the request and returns what was generated so far, with aborted=True.
    """
    rid = f"cli-{next(_request_ids)}"
    start = time.perf_counter()
    state = engine.add_request(rid, prompt, params)
    out = engine.output_processor
    aborted = False
    try:
        while not state.finished:
            engine.step()
            if write is not None:
                for seq in out.make_delta(state, 0, []).sequences:
                    if seq.index == 0 and seq.text:
                        write(seq.text)
    except KeyboardInterrupt:
        engine.abort_request(rid)
        aborted = True
    seconds = time.perf_counter() - start
    final = out.make_output(state)
    num_tokens = sum(len(o.token_ids) for o in final.outputs)
    return StreamResult([o.text for o in final.outputs], num_tokens, seconds, aborted)


def chat_prompt(engine: LLMEngine, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the chat template, ready for the assistant's turn."""
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
