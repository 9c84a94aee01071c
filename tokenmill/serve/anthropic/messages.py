"""POST /v1/messages and /v1/messages/count_tokens: an Anthropic request converted to the chat request the server
runs (convert.py), admitted through serve/admission.py like every generating surface, its output split by the
chat plan (reasoning parser, tool parsers, forced tool calls) and shaped as Anthropic's message or events."""
from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.serve.admission import admit
from tokenmill.serve.anthropic.convert import chat_request, conversation
from tokenmill.serve.anthropic.output import content_blocks, stop_reason, usage
from tokenmill.serve.anthropic.protocol import CountTokensRequest, CountTokensResponse, MessageResponse, MessagesRequest
from tokenmill.serve.anthropic.stream import stream_message
from tokenmill.serve.chat_completions import prepare_chat
from tokenmill.serve.chat_prompt import chat_prompt
from tokenmill.serve.errors import bad_request
from tokenmill.serve.generation import SSEResponse
from tokenmill.serve.state import ServerState
from tokenmill.serve.tenants.keys import tenant_of
from tokenmill.serve.tools import validate_tools


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


async def create_message(state: ServerState, req: MessagesRequest, raw: Request, arrival_time: float | None = None):
    adm = admit(state, raw, model=req.model, slo=req.slo, priority=req.priority, cache_salt=req.cache_salt,
                arrival_time=arrival_time)
    conv = conversation(req)
    chat = chat_request(req, conv)
    settings = state.settings
    if chat.tools and chat.tool_choice in (None, "auto") and not (settings.enable_auto_tool_choice
                                                                  and settings.tool_call_parser):
        raise bad_request('tool_choice "auto" (the default with tools) needs a server started with '
                          '--enable-auto-tool-choice and --tool-call-parser; or use tool_choice "any", "tool" or '
                          '"none".', "tool_choice")
    output = _output_format(req)
    if output is not None and req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        # (prepare_chat would refuse it too, naming the chat form of the choice)
        raise bad_request("output_config.format cannot be combined with tool_choice \"any\" or \"tool\": the "
                          "tool call is the output's format.", "output_config")
    plan, text, ids, params = await prepare_chat(state, chat, adm, (output, "output_config"))
    sub = await adm.submit([ids], [text], [params])
    if req.stream:
        return SSEResponse(stream_message(sub, message_id(), adm.model, plan))
    await sub.run_to_end(raw)
    choice = sub.choices[0]
    split = plan.splitter()
    reasoning_text, content, calls = split.whole(choice.full_text)
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, bool(calls))
    answer = MessageResponse(id=message_id(), model=adm.model, content=content_blocks(reasoning_text, content, calls),
                             stop_reason=reason, stop_sequence=sequence, usage=usage(sub))
    return Response(answer.model_dump_json(), media_type="application/json")


def _output_format(req: MessagesRequest) -> StructuredOutputsParams | None:
    fmt = req.output_config.format if req.output_config is not None else None
    return StructuredOutputsParams(json=fmt.schema_) if fmt is not None else None


async def count_tokens(state: ServerState, req: CountTokensRequest, raw: Request) -> CountTokensResponse:
    """The prompt /v1/messages would run for the same fields, rendered the same way, counted."""
    state.check_model(req.model, tenant_of(raw.scope))
    conv = conversation(req)
    try:
        validate_tools(conv.tools, None)
    except ValueError as e:
        raise bad_request(" ".join(str(e).split()), "tools") from None
    _, ids = await chat_prompt(state, conv.messages, not conv.prefill, conv.prefill, conv.tools,
                               conv.template_kwargs)
    return CountTokensResponse(input_tokens=len(ids))
