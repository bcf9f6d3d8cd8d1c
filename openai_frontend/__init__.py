"""OpenAI-compatible HTTP sidecar for the tritonllm Triton ensemble (chat, completions, models)."""

from .app import create_app

__all__ = ["create_app"]
