"""The tool parsers by their vLLM names (--tool-call-parser)."""
from __future__ import annotations

from tokenmill.serve.tool_parsers.base import ToolParser
from tokenmill.serve.tool_parsers.harmony import HarmonyToolParser
from tokenmill.serve.tool_parsers.hermes import HermesToolParser
from tokenmill.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenmill.serve.tool_parsers.mistral import MistralToolParser


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HarmonyToolParser, HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
