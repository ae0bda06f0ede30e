"""The OpenAI-compatible HTTP app: `create_app(engine, tokenizer, settings) -> FastAPI`.

The app talks to the engine only through `gemmax.engine.api.Engine`, so tests drive it with a fake
engine. It may be created before the model exists (`engine=None`): `gemmax serve` starts answering
`/health` (503, "loading") at once and `attach()`es the engine when it has loaded; `/health` turns
200 when the engine reports ready (warm-up done).

Request bodies are read and validated here (not by FastAPI's body parameters) so every failure is a
400 in the OpenAI error shape with a plain message, never a 422 with pydantic's internals; a JSON
route refuses any other Content-Type (415: a browser's cross-origin "simple" POST is text/plain). The
engine checks every value it receives and raises typed errors (`gemmax.engine.api`); they are mapped
to HTTP in one place (`generation.engine_error`). A pure ASGI middleware in front checks the Host
header on a loopback bind (DNS rebinding), the API key (constant-time compare, scheme in any case,
exactly one Authorization header; every route but /health and /metrics), refuses oversized bodies
(413) and counts every request by endpoint and final status. docs/server.md has the threat model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import ipaddress
import logging
import subprocess
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import gemmax
from gemmax.engine.api import InvalidRequest, check_token_ids
from gemmax.server.detokenize import TokenTable
from gemmax.server.generation import (
    STATUS_KEY,
    ApiError,
    Job,
    bad_request,
    chat_prompt,
    collect,
    completion_prompts,
    engine_error,
    stream,
)
from gemmax.server.metrics import ServerMetrics
from gemmax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    validation_message,
)

log = logging.getLogger("gemmax.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize",
                       "/health", "/metrics", "/version", "/openapi.json"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    model_root: str | None = None  # what was loaded (directory, file, hub id): /v1/models `root`
    api_key: str | None = None
    on_degenerate: Literal["flag", "error"] = "flag"
    max_body_bytes: int = 16 * 2**20
    drain_timeout: float = 30.0  # seconds the engine may finish in-flight requests at shutdown
    host: str = "127.0.0.1"  # the bind address: on a loopback bind the Host header must name loopback
    allowed_hosts: tuple[str, ...] = ()  # further Host names accepted on a loopback bind
    max_choices: int = 64  # prompts x n per call (each is an engine request)


@functools.cache
def build_info() -> dict[str, Any]:
    """Package version plus the git commit when running from a checkout."""
    commit = None
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=2)
        commit = out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"version": gemmax.__version__, "build": commit}


class ServerState:
    """What the routes share: settings, metrics, and the engine + tokenizer once they exist."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.metrics = ServerMetrics(lambda: self.engine)
        self.engine = None
        self.tokenizer = None
        self.table = TokenTable(None)
        self.load_error: str | None = None
        self.closed = False  # the app has shut down: an engine attached later is stopped at once
        self.created = int(time.time())
        self._token_strs: dict[int, str] = {}

    def attach(self, engine, tokenizer) -> None:
        """Hand over the loaded engine (it may still be warming up) and its tokenizer."""
        if self.closed:
            engine.shutdown(0.0)
            return
        self.tokenizer = tokenizer
        self.table = TokenTable(tokenizer)
        self._token_strs.clear()
        self.engine = engine

    def fail(self, message: str) -> None:
        self.load_error = message

    @property
    def engine_error(self) -> str | None:
        """Load failure, or a warm-up failure the engine reports in an `error` attribute (BatchEngine)."""
        if self.load_error is not None:
            return self.load_error
        error = getattr(self.engine, "error", None)
        return f"{type(error).__name__}: {error}" if error is not None else None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready and self.engine_error is None

    @property
    def status(self) -> str:
        if self.engine_error is not None:
            return "failed"
        if self.engine is None:
            return "loading"
        return "ready" if self.engine.ready else "warming"

    @property
    def vocab_size(self) -> int | None:
        size = self.engine.info.get("vocab_size") if self.engine is not None else None
        if size is None and self.tokenizer is not None:
            size = self.tokenizer.vocab_size
        return size

    def token_str(self, token_id: int) -> str:
        """Text of one token for logprobs (special tokens shown, as vLLM does)."""
        if token_id not in self._token_strs:
            self._token_strs[token_id] = (self.tokenizer.decode([token_id], skip_special_tokens=False)
                                          if self.tokenizer is not None else f"token_id:{token_id}")
        return self._token_strs[token_id]

    def require_ready(self):
        if not self.ready:
            detail = f" ({self.engine_error})" if self.engine_error else ""
            raise ApiError(503, f"the model is {self.status}{detail}: retry when GET /health returns 200",
                           "service_unavailable", "not_ready")
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model and model != self.settings.served_model_name:
            raise ApiError(404, f"the model `{model}` does not exist: this server serves "
                           f"`{self.settings.served_model_name}`", "not_found_error", "model_not_found", "model")

    def finish(self, job: Job, status: int) -> None:
        """Metrics and one log line for a finished generation request (however it ended)."""
        m = self.metrics
        m.prompt_tokens.inc(job.prompt_tokens)
        m.generation_tokens.inc(job.completion_tokens)
        m.e2e.observe(time.perf_counter() - job.arrival)
        degenerate = []
        for choice in job.choices:
            for gap in choice.itl:
                m.itl.observe(gap)
            result = choice.result
            if result is None:
                continue
            t = result.timings
            if choice.token_ids:
                m.ttft.observe(t.time_to_first_token_seconds)
            m.queue.observe(t.queue_seconds)
            m.decode_tokens.inc(max(len(choice.token_ids) - 1, 0))
            m.decode_seconds.inc(t.decode_seconds)
            if result.speculation is not None:
                m.spec_proposed_tokens.inc(result.speculation.proposed)
                m.spec_accepted_tokens.inc(result.speculation.accepted)
                for accepted, steps in enumerate(result.speculation.accepted_lengths):
                    for _ in range(steps):
                        m.spec_accepted.observe(accepted)
            if len(choice.token_ids) > 1:
                m.last_decode_tps.set(t.decode_tokens_per_second)
            if t.uncompiled_shape:
                m.uncompiled.inc()
            if result.degeneracy.degenerate:
                m.degenerate.inc()
                degenerate.append(f"choice {choice.index}: {result.degeneracy.reason}")
        if degenerate:
            log.warning("degenerate response %s: %s", job.id, "; ".join(degenerate))
        usage = job.usage()
        log.info("%s %s status=%d prompt=%d completion=%d finish=%s ttft=%.4fs decode=%.1f tok/s queue=%.4fs "
                 "bucket=%d uncompiled=%s", job.kind, job.id, status, job.prompt_tokens, job.completion_tokens,
                 ",".join(str(c.finish_reason) for c in job.choices), usage["time_to_first_token_seconds"],
                 usage["decode_tokens_per_second"], usage["queue_seconds"], usage["prefill_bucket"],
                 usage["uncompiled_shape"])

    def health(self) -> dict[str, Any]:
        payload: dict[str, Any] = dict(self.engine.info) if self.engine is not None else {}
        payload.update(status=self.status, model=self.settings.served_model_name, root=self.settings.model_root,
                       **build_info())
        if self.engine_error is not None:
            payload["error"] = self.engine_error
        if self.engine is not None:
            stats = self.engine.stats()
            payload.update(max_model_len=self.engine.max_model_len,
                           slots={"total": stats.slots_total, "in_use": stats.slots_in_use},
                           requests={"running": stats.running, "waiting": stats.waiting})
            if stats.prefix_cache is not None:  # the budget and its use now (the static facts are in info)
                payload["prefix_cache"] = {**(payload.get("prefix_cache") or {}), **stats.prefix_cache}
        return payload


def _json_error(status: int, message: str, type_: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code, param), status_code=status)


class GuardMiddleware:
    """API key (constant time), Content-Length limit, and the request counter, in front of the app."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        key = state.settings.api_key
        self._key = key.encode() if key else None
        settings = state.settings
        self._hosts = (LOOPBACK_NAMES | {h.lower() for h in settings.allowed_hosts}
                       if is_loopback(settings.host) else None)

    def _host_refused(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """On a loopback bind, a Host that names anything but loopback is a page reached through DNS
        rebinding (or a misdirected request): refused. Any host passes on other binds."""
        if self._hosts is None:
            return None
        hosts = [v.decode("latin-1") for k, v in headers if k == b"host"]
        if not hosts:
            return None
        host = hosts[0].strip().lower()
        if host.startswith("["):  # [::1]:8000
            name = host[: host.find("]") + 1]
        else:
            name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        if len(hosts) > 1 or (name not in self._hosts and not name.endswith(".localhost")):
            return hosts[0]
        return None

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Exactly one Authorization header, scheme `Bearer` in any case, the key compared in
        constant time."""
        values = [v for k, v in headers if k == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        return hmac.compare_digest(scheme.lower() + b" " + token.strip(), b"bearer " + self._key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        raw_headers = scope["headers"]
        headers = dict(raw_headers)
        seen: dict[str, Any] = {}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            await send(message)

        try:
            refused_host = self._host_refused(raw_headers)
            if refused_host is not None:
                response = _json_error(400, f"Host {refused_host!r} is not served here: this server is bound to "
                                       "loopback and answers only requests addressed to localhost (DNS rebinding "
                                       "defence; add names with --allowed-host)", "invalid_request_error",
                                       "invalid_host")
                return await response(scope, receive, send_counted)
            if self._key is not None and path not in OPEN_PATHS and not self._authorized(raw_headers):
                response = _json_error(401, "invalid or missing API key (send exactly one 'Authorization: Bearer "
                                       "<key>' header)", "authentication_error", "invalid_api_key")
                return await response(scope, receive, send_counted)
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.state.settings.max_body_bytes):
                response = _json_error(413, f"request body of {length.decode(errors='replace')} bytes is over the "
                                       f"limit of {self.state.settings.max_body_bytes} bytes", "request_too_large",
                                       "request_too_large")
                return await response(scope, receive, send_counted)
            await self.app(scope, receive, send_counted)
        except Exception:
            seen.setdefault("status", 500)
            raise
        finally:
            # A stream's outcome is known only at its end (STATUS_KEY); no response at all: client gone.
            status = scope.get(STATUS_KEY, seen.get("status", 499))
            self.state.metrics.requests.labels(endpoint, str(status)).inc()


class EventStream(StreamingResponse):
    """SSE response that closes its generator however the response ends, so a client that goes
    away has its engine requests cancelled at once (not whenever the generator is collected)."""

    media_type = "text/event-stream"

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


async def _read(request: Request, model: type[BaseModel], limit: int) -> Any:
    """Body -> validated model; 415 unless the body is declared JSON, 413 over the limit (chunked
    bodies too), 400 for anything invalid."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"Content-Type must be application/json (got {media or 'none'!r})",
                       "invalid_request_error", "unsupported_media_type")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes", "request_too_large",
                           "request_too_large")
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise bad_request(message, param) from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(engine=None, tokenizer=None, settings: ServerSettings | None = None) -> FastAPI:
    """The app over `engine` (anything implementing gemmax.engine.api.Engine; None: attach later via
    `app.state.gemmax.attach`). The app owns the engine: it is shut down (drained) with the app."""
    settings = settings or ServerSettings(served_model_name="gemmax")
    state = ServerState(settings)
    if engine is not None:
        state.attach(engine, tokenizer)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        state.closed = True
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown, settings.drain_timeout)

    app = FastAPI(title="gemmax", version=gemmax.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gemmax = state
    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        response = _json_error(exc.status, exc.message, exc.type, exc.code, exc.param)
        response.headers.update(exc.headers or {})
        if exc.status == 500:  # a fault: the client must not reuse this connection
            response.headers["Connection"] = "close"
        return response

    @app.exception_handler(InvalidRequest)
    async def _invalid(_request: Request, exc: InvalidRequest) -> JSONResponse:
        return await _api_error(_request, engine_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # Routes validate their bodies themselves; this keeps any other validation failure a plain 400.
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request"))
        return _json_error(400, message, "invalid_request_error", "invalid_value", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json_error(exc.status_code, str(exc.detail), type_, type_)

    @app.exception_handler(Exception)
    async def _fault(_request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response, so uvicorn logs the traceback and drops the
        # connection; `Connection: close` tells the client not to reuse it. The server goes on.
        response = _json_error(500, f"internal error: {type(exc).__name__}", "server_error", "internal_error")
        response.headers["Connection"] = "close"
        return response

    async def generate(request: Request, kind: str, body: ChatCompletionRequest | CompletionRequest):
        state.check_model(body.model)
        engine = state.require_ready()
        count = (1 if kind == "chat" else len(body.prompt)) * body.n
        if count > settings.max_choices:
            raise bad_request(f"this request asks for {count} completions ({count // body.n} prompts x n={body.n}); "
                              f"this server allows at most {settings.max_choices} per request", "n",
                              "too_many_completions")
        if kind == "chat":
            prompts = [chat_prompt(state.tokenizer, body.messages, body.add_generation_prompt,
                                   body.continue_final_message, body.tools, body.chat_template_kwargs)]
        else:
            prompts = completion_prompts(state.tokenizer, body, state.vocab_size)
        job = Job(state, kind, body, prompts, request.scope)
        job.submit(engine, asyncio.get_running_loop(), state.tokenizer, state.table)
        if body.stream:
            return EventStream(stream(job), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        status = 500
        work = asyncio.create_task(collect(job))
        gone = asyncio.create_task(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                status = 499  # the client went away: cancel, answer nobody
                work.cancel()
                return Response(status_code=499)
            response = JSONResponse(work.result())
            status = 200
            return response
        except ApiError as exc:
            status = exc.status
            raise
        except Exception as exc:
            log.exception("request %s failed", job.id)
            raise ApiError(500, f"internal error: {type(exc).__name__}", "server_error", "internal_error") from exc
        finally:
            gone.cancel()
            job.close()
            state.finish(job, status)

    def body_of(model: type[BaseModel]) -> dict[str, Any]:
        """OpenAPI requestBody for a route that reads its body itself (served at /openapi.json)."""
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}

    @app.post("/v1/chat/completions", openapi_extra=body_of(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await generate(request, "chat", await _read(request, ChatCompletionRequest, settings.max_body_bytes))

    @app.post("/v1/completions", openapi_extra=body_of(CompletionRequest))
    async def completions(request: Request):
        return await generate(request, "completion", await _read(request, CompletionRequest, settings.max_body_bytes))

    @app.get("/health")
    async def health():
        return JSONResponse(state.health(), status_code=200 if state.ready else 503)

    @app.get("/version")
    async def version():
        return build_info()

    @app.get("/v1/models")
    async def models():
        engine = state.require_ready()
        card = {"id": settings.served_model_name, "object": "model", "created": state.created, "owned_by": "gemmax",
                "root": settings.model_root or settings.served_model_name, "parent": None,
                "max_model_len": engine.max_model_len, "vocab_size": state.vocab_size, "permission": []}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", openapi_extra=body_of(TokenizeRequest))
    async def tokenize(request: Request):
        body = await _read(request, TokenizeRequest, settings.max_body_bytes)
        state.check_model(body.model)
        engine = state.require_ready()
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        if body.messages is not None:
            prompt = chat_prompt(state.tokenizer, body.messages, body.add_generation_prompt,
                                 body.continue_final_message, body.tools, body.chat_template_kwargs)
            ids = prompt.ids if not body.add_special_tokens else state.tokenizer.encode(prompt.text)
        else:
            ids = state.tokenizer.encode(body.prompt, add_bos=body.add_special_tokens is not False)
        strs = [state.tokenizer.backend.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", openapi_extra=body_of(DetokenizeRequest))
    async def detokenize(request: Request):
        body = await _read(request, DetokenizeRequest, settings.max_body_bytes)
        state.check_model(body.model)
        state.require_ready()
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        check_token_ids("tokens", body.tokens, state.vocab_size)
        return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the request models the routes validate themselves."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest):
                definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(definition.pop("$defs", {}))
                components[model.__name__] = definition
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    return app

