"""GET /: the chat page, one static HTML file that talks to this sidecar's OpenAI API.

Like llama.cpp's server page: a conversation streamed from ``/v1/chat/completions``
(``stream: true``), a Stop button (an ``AbortController``: the closed connection makes the
sidecar abort the generation and free its KV cache), the sampling settings, tokens/s, and an
API key field sent as ``Authorization: Bearer``. The page has no build step and loads nothing
from elsewhere (``static/chat.html``: inline CSS and JavaScript).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = Path(__file__).resolve().parent / "static" / "chat.html"

router = APIRouter()


@cache
def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def chat_page() -> HTMLResponse:
    """The chat page (``text/html``)."""
    return HTMLResponse(_page())
