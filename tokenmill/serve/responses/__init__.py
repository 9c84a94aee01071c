"""OpenAI's Responses API (`/v1/responses`) over the chat path.

A Responses request is read into a chat conversation (`conversation.py`: input items, instructions, the stored
history of `previous_response_id`, tools, tool_choice, text.format) and then runs exactly as a chat completion
does: the same admission (serve/admission.py), template and tokenization (serve/chat_prompt.py), tool and
reasoning split (serve/chat_output.py), structured output (serve/structured.py) and sampling checks
(serve/sampling.py). What differs is the answer: output items (`output.py`: reasoning, message, function_call),
the typed stream events (`output.py`), the Response object (`protocol.py`) and the store behind GET, DELETE and
`previous_response_id` (`store.py`). `create.py` ties them together; routes/responses.py is the HTTP side.
"""
