"""Tool calls in generated text, per model family (vLLM's parser names): whole outputs and streams.

Content is the text outside the calls, joined, with its leading and trailing whitespace stripped (None
when nothing is left); a stream drops the same whitespace, so its content fragments join to exactly
`extract(...).content`. A stream commits to a call as soon as its name is complete and then sends the
arguments' JSON text as it arrives; a call that breaks after that point (truncated or malformed JSON)
is closed as it stands, where `extract`, which sees the whole text, leaves it in the content.

The package: calls.py (what a parser returns, call-object JSON), base.py (ToolParser, the streaming state machine),
one module per format family (hermes.py, llama3_json.py, mistral.py, harmony.py), registry.py (the parsers by name).
"""
from __future__ import annotations

from tokenmill.serve.tool_parsers.base import ToolParser
from tokenmill.serve.tool_parsers.calls import (ARG_KEYS, ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta,
                                                dumps_arguments)
from tokenmill.serve.tool_parsers.harmony import HarmonyToolParser
from tokenmill.serve.tool_parsers.hermes import HermesToolParser
from tokenmill.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenmill.serve.tool_parsers.mistral import MistralToolParser
from tokenmill.serve.tool_parsers.registry import TOOL_PARSERS, get_tool_parser

__all__ = ["ARG_KEYS", "ExtractedToolCalls", "HarmonyToolParser", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "StreamDelta", "TOOL_PARSERS", "ToolCall", "ToolCallDelta", "ToolParser", "dumps_arguments",
           "get_tool_parser"]
