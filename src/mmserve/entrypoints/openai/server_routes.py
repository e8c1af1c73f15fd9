"""The routes that describe the server rather than run the model, with vLLM's paths.

Open to anyone (load balancers and probes call them, as vLLM leaves them): `GET /health` (200 while
some rank serves, with each rank's state as JSON when there are several; else 503 with the reason),
`GET|POST /ping` (the same verdict, SageMaker's path), `GET /version` and `GET /metrics`
(Prometheus text). Behind the API key with the rest of /v1: `GET /v1/models` and
`GET /v1/models/{model}` (OpenAI's retrieve; a 404 naming the served models for another name).
"""

from __future__ import annotations

import json
import time
from importlib import metadata
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from mmserve.entrypoints.openai.errors import OpenAIError
from mmserve.entrypoints.openai.serving_base import model_not_found
from mmserve.metrics import CONTENT_TYPE, ServerMetrics

if TYPE_CHECKING:
    from mmserve.frontend.async_llm import AsyncLLM


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mmserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def version() -> str:
    """mmserve's installed version ("unknown" when run from a tree that was never installed)."""
    try:
        return metadata.version("mmserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def status_routes(engine: AsyncLLM, metrics: ServerMetrics) -> APIRouter:
    """/health, /ping, /version and /metrics."""
    routes = APIRouter()

    @routes.get("/health")
    async def health() -> Response:
        return _health(engine)

    @routes.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return _health(engine)

    @routes.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": version()}

    @routes.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return routes


def _health(engine: AsyncLLM) -> Response:
    ranks = getattr(engine, "ranks", None)
    if engine.is_healthy and (ranks is None or bool(ranks.live())):
        return Response(status_code=200) if ranks is None or len(ranks) == 1 else \
            JSONResponse({"status": "ok", "ranks": ranks.health()})
    reason = getattr(engine, "dead_error", None) or "no engine core is serving"
    response = OpenAIError(503, f"unhealthy: {reason}", code="engine_dead").to_response()
    if ranks is not None:
        response = JSONResponse({**json.loads(bytes(response.body)), "ranks": ranks.health()}, status_code=503)
    return response


def add_model_routes(v1: APIRouter, engine: AsyncLLM, served_model_names: list[str]) -> None:
    """`GET /v1/models` and `GET /v1/models/{model}` on the /v1 router."""

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=engine.model_dir, max_model_len=engine.max_model_len)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in served_model_names])

    @v1.get("/models/{model:path}")
    async def model(model: str) -> ModelCard:
        if model not in served_model_names:
            raise model_not_found(model, served_model_names)
        return card(model)
