"""GET /v1/models and GET /v1/models/{model} (``/health`` is in ``openai_frontend/health.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol import ModelCard, ModelList
from .common import check_model, get_state

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """The one served model."""
    return ModelList(data=[ModelCard(id=get_state(request).model_name)])


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> ModelCard:
    """The served model's card. Raises: OpenAIError 404 for any other name."""
    state = get_state(request)
    check_model(state, model)
    return ModelCard(id=state.model_name)
