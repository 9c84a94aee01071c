"""Engine logprobs ({token id: Logprob} per position) -> OpenAI's completions and chat shapes."""
from __future__ import annotations

from typing import Callable

from tokenmill.outputs import PositionLogprobs
from tokenmill.serve.protocol import ChatLogprobs, ChatLogprobToken, CompletionLogprobs, TopLogprob


def _token_str(entry_token: str | None, token_id: int, decode: Callable[[int], str]) -> str:
    return entry_token if entry_token is not None else decode(token_id)


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], text_offset: int,
                        decode: Callable[[int], str]) -> CompletionLogprobs:
    """`positions[i]` holds the chosen token and the top alternatives (None: no logprob, e.g. the first
    prompt token). Offsets count characters from the start of the returned text."""
    out = CompletionLogprobs()
    offset = text_offset
    for tok, pos in zip(token_ids, positions):
        if pos is None or tok not in pos:
            text = decode(tok)
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            text = _token_str(pos[tok].decoded_token, tok, decode)
            out.tokens.append(text)
            out.token_logprobs.append(pos[tok].logprob)
            # OpenAI: the top `logprobs` tokens plus the chosen one.
            out.top_logprobs.append({_token_str(lp.decoded_token, t, decode): lp.logprob for t, lp in pos.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top_n: int,
                  decode: Callable[[int], str]) -> ChatLogprobs:
    content = []
    for tok, pos in zip(token_ids, positions):
        chosen = pos[tok]
        text = _token_str(chosen.decoded_token, tok, decode)
        best = sorted(pos.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top_n]
        top = [TopLogprob(token=(s := _token_str(lp.decoded_token, t, decode)), logprob=lp.logprob,
                          bytes=list(s.encode("utf-8"))) for t, lp in best]
        content.append(ChatLogprobToken(token=text, logprob=chosen.logprob, bytes=list(text.encode("utf-8")),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)
