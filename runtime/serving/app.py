"""The FastAPI app of `infhip-serve`: routes, body limits, and one error format everywhere,
``{"error": {"message", "type", "code"}}`` (code = the HTTP status), FastAPI's own 404/405/422
answers included.

Every generating route: read the body (at most `max_body_bytes`, within `body_timeout_s`, else
413 / 408), validate it (400), tokenize off the engine thread, hand it to the engine (400 if the
engine refuses the prompt), then answer as one JSON object or as server-sent events. A client
that disconnects while its request waits or generates, streaming or not, has it aborted.

The lifecycle (runtime/serving/lifecycle.py): a generating request first takes a `Ticket`
(429 when the server is full, 503 while draining), counts its prompt tokens once tokenized (429
past the token budget) and carries a deadline into the engine; a request the engine ended with
"abort" that its client did not leave (its deadline passed, or the drain ran out) ends with a
last chunk whose finish_reason is "abort" and [DONE] when streaming, or an error body (504 / 503).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from importlib.metadata import PackageNotFoundError, version
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from infhip.runtime.serving import protocol as P
from infhip.runtime.serving import responses as R
from infhip.runtime.serving.access_log import AccessTokens, tokens_of
from infhip.runtime.serving.async_engine import AsyncEngine, ClientGone, EngineFailure, Generation
from infhip.runtime.serving.lifecycle import Lifecycle, Refused, Ticket
from infhip.runtime.serving.metrics import CONTENT_TYPE, ServerMetrics
from infhip.runtime.serving.shapes import ChatShape, CompletionShape, token_strings
from infhip.runtime.serving.tool_calls import ToolCallPlan

ENDPOINTS = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /tokenize",
             "POST /detokenize", "GET /health", "GET /health/live", "GET /health/ready", "GET /metrics",
             "GET /version")  # the GET routes answer HEAD too (headers alone): aiperf probes /metrics so


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 8 << 20  # a 1M-token prompt as text is ~4 MB
    body_timeout_s: float = 30.0  # the whole body, from the end of the headers


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def error_body(status: int, message: str) -> dict:
    kind = ("invalid_request_error" if status < 500 else "service_unavailable" if status == 503
            else "timeout" if status == 504 else "server_error")
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def make_app(engine: AsyncEngine, metrics: ServerMetrics, model_name: str | list[str], limits: HttpLimits,
             lifecycle: Lifecycle) -> FastAPI:
    """model_name: the served name(s) (--served-model-name); a request naming another model gets 404."""
    app = FastAPI(title="infhip-serve", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    token_str = token_strings(engine.tokenizer)

    def served(model: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if model is None:
            return names[0]
        if model not in names:
            raise ApiError(404, f"the model `{model}` does not exist; this server serves {', '.join(names)}")
        return model

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not engine.loop.alive:
            return error_response(503, f"the engine thread is not running ({engine.loop.death!r})")
        return {"status": "ok"}

    @app.api_route("/health/live", methods=["GET", "HEAD"])
    async def health_live():
        why = lifecycle.live()
        return error_response(503, why) if why else {"status": "live"}

    @app.api_route("/health/ready", methods=["GET", "HEAD"])
    async def health_ready():
        why = lifecycle.ready()
        return error_response(503, why) if why else {"status": "ready"}

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def server_version():
        try:
            return {"version": version("infhip")}
        except PackageNotFoundError:  # run from a checkout without an install
            from infhip import __version__
            return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = P.parse_body(P.TokenizeRequest, await read_body(request, limits))
        if body.messages is not None:
            _, ids = await engine.encode_chat([m.for_template() for m in body.messages])
        else:
            ids = await engine.encode(body.prompt, body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.limits.max_seq_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = P.parse_body(P.DetokenizeRequest, await read_body(request, limits))
        if any(not 0 <= t < engine.limits.vocab_size for t in body.tokens):
            raise ApiError(400, f"tokens must be in [0, {engine.limits.vocab_size})")
        return {"prompt": await engine.decode(body.tokens)}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "infhip",
                                            "max_model_len": engine.limits.max_seq_len} for name in names]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        ticket = lifecycle.admit()
        try:
            body = P.parse_body(P.CompletionRequest, await read_body(request, limits))
            model = served(body.model)
            params = body.sampling_params(body.max_tokens, engine.limits)
            prompts = []  # (text or None, token ids)
            for p in body.prompts:
                ids = await engine.encode(p, body.add_special_tokens) if isinstance(p, str) else p
                prompts.append((p if isinstance(p, str) else None, ids))
            echoed = ([(t if t is not None else await engine.decode(ids), ids) for t, ids in prompts]
                      if body.echo else [])
            shape = CompletionShape(R.new_meta("cmpl", model), token_str, echoed, params.n, body.echo,
                                    discard=body.max_tokens == 0)
            return await _generate(engine, lifecycle, ticket, request, prompts, params, shape, body)
        finally:
            ticket.release_unless_streaming()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ticket = lifecycle.admit()
        try:
            body = P.parse_body(P.ChatCompletionRequest, await read_body(request, limits))
            model = served(body.model)
            params = body.sampling_params(body.max_new_tokens, engine.limits)
            tools, params = _tool_plan(body, engine, params)
            text, ids = await engine.encode_chat([m.for_template() for m in body.messages],
                                                 tools.tools if tools is not None else None, body.chat_template_kwargs)
            shape = ChatShape(R.new_meta("chatcmpl", model), token_str, [], params.n,
                              discard=body.max_new_tokens == 0, tools=tools)
            return await _generate(engine, lifecycle, ticket, request, [(text, ids)], params, shape, body)
        finally:
            ticket.release_unless_streaming()

    return app


def _tool_plan(body: P.ChatCompletionRequest, engine: AsyncEngine, params):
    """(the request's ToolCallPlan or None, params with the grammar that forces its calls)."""
    if not body.tools and body.tool_choice is None:  # no tools: ToolCallPlan.of would say None
        return None, params
    template = getattr(engine.tokenizer, "chat_template", None)
    try:
        plan = ToolCallPlan.of(body.tools, body.tool_choice, template if isinstance(template, str) else None,
                               parallel=body.parallel_tool_calls is not False)
    except ValueError as e:
        raise P.BadRequest(str(e)) from None
    if plan is None or plan.structured_outputs is None:
        return plan, params
    if params.structured_outputs is not None:
        raise P.BadRequest("tool_choice \"required\" or a named function is itself an output constraint; "
                           "send response_format / structured_outputs without it")
    return plan, dataclasses.replace(params, structured_outputs=plan.structured_outputs)


async def read_body(request: Request, limits: HttpLimits) -> bytes:
    """The request body; 413 past max_body_bytes (before reading when Content-Length says so),
    408 when it has not all arrived within body_timeout_s (a Content-Length above what is sent)."""
    declared = request.headers.get("content-length")  # the HTTP parser has checked it is a number
    if declared is not None and int(declared) > limits.max_body_bytes:
        raise ApiError(413, f"the body is {declared} bytes; the limit is {limits.max_body_bytes} (--max-body-bytes)")
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise ApiError(413, f"the body exceeds {limits.max_body_bytes} bytes (--max-body-bytes)")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), limits.body_timeout_s)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {limits.body_timeout_s:g} s "
                            f"({size} bytes of {declared or 'an unknown length'} received)") from None
    return b"".join(chunks)


async def _generate(engine: AsyncEngine, lifecycle: Lifecycle, ticket: Ticket, request: Request, prompts,
                    params, shape, body) -> Response:
    """prompts: (text or None, token ids) each, one engine request apiece (one when streaming)."""
    if params.structured_outputs is not None:  # off the engine thread (AsyncEngine.compile_grammar)
        try:
            await engine.compile_grammar(params.structured_outputs)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
    ticket.add_prompt(sum(len(ids) for _, ids in prompts))
    lifecycle.check_not_ending()
    gens = [Generation(engine.loop, request.receive) for _ in prompts]
    deadline = ticket.deadline(body.timeout)
    try:
        prompt_tokens = 0
        for gen, (text, ids) in zip(gens, prompts):
            prompt_tokens += await gen.start(text, ids, params, deadline)
    except ValueError as e:  # the engine refused the prompt (too long, token id out of range, ...)
        _close(gens)
        raise ApiError(400, str(e)) from None
    except ClientGone:
        _close(gens)
        return Response(status_code=499)  # nobody reads it
    except Exception as e:
        _close(gens)
        raise ApiError(503 if not engine.loop.alive else 500, f"the engine failed: {type(e).__name__}: {e}") from None
    ended = _Ended(lifecycle, deadline, body.timeout)
    ticket.start(prompt_tokens, len(gens) * (params.best_of or params.n) * params.max_tokens)
    logged = tokens_of(request.scope)  # the access log's line (access_log.py)
    logged.prompt_tokens, logged.completion_tokens = prompt_tokens, 0
    if body.stream:
        ticket.streaming = True  # released when the stream ends
        return _Stream(gens[0], ticket, _events(gens[0], ticket, shape, prompt_tokens, body.include_usage,
                                                body.continuous_usage, logged))
    try:
        return await _whole(gens, ticket, shape, prompt_tokens, ended, logged)
    finally:
        _close(gens)


def _close(gens: list[Generation]) -> None:
    for gen in gens:
        gen.close()


class _Stream(StreamingResponse):
    """The SSE response; whatever ends it (its last event, the client leaving, the server
    cancelling it), the request leaves the engine and gives its ticket back."""

    def __init__(self, gen: Generation, ticket: Ticket, events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen, self._ticket = gen, ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()
            self._ticket.release()


class _Ended:
    """Why the engine ended a request with "abort" although its client stayed: its deadline
    passed (504), or the server's drain ran out (503)."""

    def __init__(self, lifecycle: Lifecycle, deadline: float | None, requested_s: float | None):
        self.lifecycle, self.deadline, self.requested_s = lifecycle, deadline, requested_s

    def response(self, num_tokens: int) -> Response:
        if self.deadline is not None and time.monotonic() >= self.deadline and not self.lifecycle.ending:
            limit = self.lifecycle.policy.request_timeout_s
            what = (f"timeout={self.requested_s:g} s" if self.requested_s and (not limit or self.requested_s <= limit)
                    else f"--request-timeout {limit:g} s")
            return error_response(504, f"the request's deadline ({what}, from its arrival) passed after "
                                       f"{num_tokens} generated tokens; it was aborted")
        retry = {"Retry-After": str(self.lifecycle.policy.retry_after_s)}
        return error_response(503, f"the server is shutting down and ended the request after {num_tokens} "
                                   "generated tokens; send it to another replica", retry)


async def _whole(gens: list[Generation], ticket: Ticket, shape, prompt_tokens: int, ended: _Ended,
                 logged: AccessTokens) -> Response:
    """One JSON response of every prompt's choices (gens[i]: prompt i's engine request)."""
    lasts, cached = [], [0] * len(gens)

    async def collect(i: int, gen: Generation) -> None:
        async for delta in gen.deltas():
            ticket.work.generated(len(delta.token_ids))
            shape.add(delta, i)
            logged.completion_tokens = shape.num_tokens
            lasts.append(delta)
            cached[i] = delta.num_cached_tokens

    try:
        await asyncio.gather(*(collect(i, gen) for i, gen in enumerate(gens)))
    except EngineFailure as e:
        return error_response(500, f"the engine failed: {e}")
    except ClientGone:
        return Response(status_code=499)
    reasons = {d.finish_reason for d in lasts}
    if "error" in reasons:
        return error_response(500, _request_error(next(d for d in lasts if d.finish_reason == "error")))
    if "abort" in reasons:  # not the client's doing: it is still here
        return ended.response(shape.num_tokens)
    use = R.usage(prompt_tokens, shape.num_tokens, sum(cached))
    return JSONResponse(shape.whole(use))


async def _events(gen: Generation, ticket: Ticket, shape, prompt_tokens: int,
                  include_usage: bool, continuous_usage: bool, logged: AccessTokens) -> AsyncIterator[bytes]:
    """The SSE body: one chunk per delta (a chat choice's first carries its role with its first
    token; with continuous_usage each carries the usage so far, as vLLM's do), the usage chunk
    if asked, then [DONE]; a failed request ends with one error event instead. A request the
    server ended (deadline, drain) ends like any other: its last chunk has finish_reason "abort"."""
    try:
        cached = 0
        async for delta in gen.deltas():
            cached = delta.num_cached_tokens
            if delta.finish_reason == "error":
                yield _sse(error_body(500, _request_error(delta)))
                return
            ticket.work.generated(len(delta.token_ids))
            chunk = shape.chunk(delta)
            logged.completion_tokens = shape.num_tokens
            if continuous_usage:
                chunk["usage"] = R.usage(prompt_tokens, shape.num_tokens, cached)
            yield _sse(chunk)
        if include_usage:
            yield _sse(R.usage_chunk(shape.meta, shape.chunk_object, R.usage(prompt_tokens, shape.num_tokens, cached)))
        yield b"data: [DONE]\n\n"
    except EngineFailure as e:
        yield _sse(error_body(500, f"the engine failed: {e}"))
    except ClientGone:
        return
    finally:
        gen.close()  # the ticket goes back in _Stream, once the response's last byte is out


def _request_error(delta) -> str:
    # StreamDelta.error: why the engine failed this request alone (finish_reason "error")
    return f"the request failed in the engine: {getattr(delta, 'error', None) or 'no reason given'}"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused):
        return error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(P.BadRequest)
    async def bad_request(request: Request, exc: P.BadRequest):
        return error_response(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"no endpoint {where}; endpoints: {', '.join(ENDPOINTS)}"
        elif exc.status_code == 405:
            message = f"{where} is not allowed; {request.url.path} takes {(exc.headers or {}).get('Allow', '?')}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, "; ".join(str(e.get("msg")) for e in exc.errors()))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect):
        return Response(status_code=499)  # left while sending the body: nobody reads this

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
