"""GET /v1/models and GET /v1/models/{model} (``/health`` is in ``openai_frontend/health.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol import ModelCard, ModelList
from .common import ServerState, check_model, get_state

router = APIRouter()


async def _card(state: ServerState) -> ModelCard:
    name = state.model_name
    limit = await state.context_limit()
    return ModelCard(id=name, created=state.created, root=name, max_model_len=limit)


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """The one served model (with its ``max_model_len``, vLLM's field)."""
    return ModelList(data=[await _card(get_state(request))])


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> ModelCard:
    """The served model's card. Raises: OpenAIError 404 for any other name."""
    state = get_state(request)
    check_model(state, model)
    return await _card(state)
