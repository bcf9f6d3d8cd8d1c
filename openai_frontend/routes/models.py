"""GET /v1/models, GET /v1/models/{model} and GET /health."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

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


@router.get("/health", response_model=None)
async def health(request: Request) -> JSONResponse:
    """200 when Triton and the ``llm`` model are ready, 503 otherwise."""
    ready = await get_state(request).client.is_ready()
    status = "ok" if ready else "triton not ready"
    return JSONResponse({"status": status}, status_code=200 if ready else 503)
