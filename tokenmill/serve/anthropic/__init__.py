"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens): `protocol` (its request, response and
event schemas), `convert` (its content blocks as the chat messages the template renders), `output` (blocks,
stop_reason, usage), `stream` (its server-sent events) and `messages` (the two routes' work)."""
