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
    """200 when Triton and the ``llm`` model are ready and the generator answers, else 503.

    Triton keeps reporting a model ready after its Python stub process died (2.51), so the
    generator is also sent its ``health_probe`` control request, which only reports whether
    its engine runs (it aborts nothing).
    """
    client = get_state(request).client
    if not await client.is_ready():
        return JSONResponse({"status": "triton not ready"}, status_code=503)
    if not await client.probe(timeout=2.0):
        return JSONResponse({"status": "generator not answering"}, status_code=503)
    return JSONResponse({"status": "ok"}, status_code=200)
