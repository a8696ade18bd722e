"""The Starlette app: OpenAI's (chat completions, completions, Responses), Anthropic's and Ollama's routes over one
engine, /health, CORS for the origins given, and every refusal the routes do not answer themselves (no such path,
wrong method, a bug) in the error shape of the API the path belongs to."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import anthropic_api, ollama_api, openai_api, responses_api
from .engine import Engine
from .hardening import Limits
from .protocol import error_response
from .request import Server

PATHS = (
    "POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST /v1/messages, GET /v1/models, "
    "GET /health and Ollama's /api/*"
)


def api_error(path: str, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An error in the shape of the API the path belongs to: Anthropic's under /v1/messages, Ollama's under /api/,
    else OpenAI's."""
    if path.startswith("/v1/messages"):
        return anthropic_api.error_response(status, message, headers)
    if path.startswith("/api/"):
        return ollama_api.error_response(status, message, headers)
    return error_response(status, message, headers=headers)


def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such path, wrong method) in the shape of the path's API."""
    where = f"{request.method} {request.url.path}"
    messages = {
        404: f"Invalid URL ({where}): this server answers {PATHS}.",
        405: f"{where} is not allowed: use {(exc.headers or {}).get('Allow', '')}.",
    }
    return api_error(request.url.path, exc.status_code, messages.get(exc.status_code, exc.detail), exc.headers)


def _server_error(request: Request, exc: Exception) -> Response:
    """A bug's answer: a 500 in the shape of the path's API (uvicorn logs the traceback)."""
    return api_error(request.url.path, 500, f"The server failed ({type(exc).__name__}: {exc}).")


def create_app(
    engine: Engine,
    model: str,
    api_key: str | None = None,
    limits: Limits = Limits(),
    cors_origins: tuple[str, ...] = (),
) -> Starlette:
    """The app: OpenAI's and Anthropic's /v1 routes, Ollama's /api routes and /health; browsers from cors_origins
    only."""
    server = Server(engine, model, api_key, limits)

    async def health(request: Request) -> Response:
        state = {"status": "ok", "model": model, "busy": engine.busy, "queued": engine.queued()}
        return JSONResponse(state | engine.state() | engine.counts)

    routes = [*openai_api.routes(server), *responses_api.routes(server), *anthropic_api.routes(server)]
    routes += ollama_api.routes(server)
    routes.append(Route("/health", health, methods=["GET"]))
    cors = [Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"])]
    app = Starlette(
        routes=routes,
        middleware=cors if cors_origins else [],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.router.redirect_slashes = False  # /v1/models/ is a 404, not a redirect
    return app
