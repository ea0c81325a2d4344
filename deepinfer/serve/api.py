"""The FastAPI app: error handlers, the OpenAPI document, and the routes of serve/routes.py.

Every request is parsed and checked (serve/checks.py: size, UTF-8, JSON, fields, model
name, vocabulary, length, queue room) before anything reaches the engine thread; the
responses are written by serve/streaming.py. A request with n choices (or several
prompts) runs as one engine sequence per choice; their outputs are merged there.
The OpenAPI document publishes the pydantic request models as the request bodies
(the handlers read the raw body themselves, to bound it before parsing).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.serve.errors import APIError, ClientGone
from deepinfer.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from deepinfer.serve.responses_protocol import ResponsesRequest
from deepinfer.serve.routes import ROUTES
from deepinfer.serve.server_state import ServerState
from deepinfer.serve.ui_routes import add_ui_routes

__all__ = ["ServerState", "build_app", "openapi_document"]

log = logging.getLogger("deepinfer.serve")
REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
                  "/v1/responses": ResponsesRequest}


def openapi_document(app: FastAPI) -> dict:
    """FastAPI's document, with each POST route's pydantic model as its JSON request body."""
    doc = get_openapi(title=app.title, version="1", routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return doc


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="deepinfer", lifespan=lifespan)
    app.state.deepinfer = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # unknown routes and methods answer in OpenAI's error shape, not FastAPI's {"detail": ...}
        if exc.status_code == 404:
            message = f"no route {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        log.info("%s", exc)  # nobody is left to read a response
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.body(), status_code=500)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi

    if state.ui:  # the built-in page at / (serve/ui_routes.py)
        add_ui_routes(app)
    for method, path, handler in ROUTES:
        app.add_api_route(path, handler, methods=[method])
    return app
