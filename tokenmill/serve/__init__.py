"""OpenAI-compatible HTTP server: `tokenmill serve` (FastAPI + uvicorn over AsyncLLMEngine)."""
from tokenmill.serve.state import ServerSettings, ServerState

__all__ = ["ServerSettings", "ServerState"]
