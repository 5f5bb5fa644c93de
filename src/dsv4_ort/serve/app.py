"""The OpenAI-compatible HTTP application (Starlette) over an :class:`~dsv4_ort.runtime.engine.Engine`.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics. The engine
runs on its own thread; each request's events reach the event loop through ``call_soon_threadsafe`` into an
asyncio queue. A request whose client goes away (mid-stream or while waiting for a non-streamed answer) is
cancelled, which frees its state row within one engine step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections import Counter

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runtime.engine import EngineStopped, PromptTooLong, QueueFull
from . import metrics as prom
from .protocol import (APIError, ReasoningSplitter, ToolCallParser, bad, chat_chunk, chat_response, completion_chunk,
                       completion_response, new_id, now, parse_chat, parse_completion, usage_chunk)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _Stream(StreamingResponse):
    """StreamingResponse that always watches for the client's disconnect (whatever ASGI spec version the server
    announces) and, when the client leaves, stops the body; the body's ``finally`` cancels the engine request."""

    async def __call__(self, scope, receive, send):
        task = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, watch):
                if not t.done():
                    t.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


class Server:
    """State shared by the handlers: the engine, the model's name, its tokenizer and the HTTP counters."""

    def __init__(self, engine, model_name: str, api_key: str | None = None):
        self.engine = engine
        self.session = engine.session
        self.model = model_name
        self.api_key = api_key
        self.eos = self.session.config.get("eos_token_id")
        self.http = Counter()
        self.created = now()

    # ---- helpers -------------------------------------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    async def body(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:
            raise APIError(404, f"the model {model!r} does not exist (this server serves {self.model!r})",
                           param="model", code="model_not_found")
        return body

    def prompt_ids(self, parsed) -> list:
        if parsed.prompt_ids is not None:
            return parsed.prompt_ids
        if self.session.tokenizer is None:
            raise bad(f"the model {self.model!r} has no tokenizer: send the prompt as token ids", param="prompt")
        return self.session.encode(parsed.prompt_text, add_special_tokens=parsed.add_special_tokens)

    def submit(self, ids, parsed, param: str):
        """Submits to the engine; returns (request, asyncio queue of its events). ``param``: the field that holds
        the prompt (named by a too-long error)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(ev):
            loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            req = self.engine.submit(ids, parsed.params, on_event=deliver)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}", type="rate_limit_exceeded", code="queue_full") from None
        except PromptTooLong as e:
            raise bad(str(e), param=param, code="context_length_exceeded") from None
        except EngineStopped as e:
            raise APIError(503, f"the server is shutting down ({e})", type="server_error") from None
        except (TypeError, ValueError) as e:
            raise bad(str(e)) from None
        return req, events

    @staticmethod
    async def collect(req, events, request: Request) -> tuple:
        """Waits for every event of a non-streamed request; cancels it if the client disconnects."""
        async def gone():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watch = asyncio.ensure_future(gone())
        out = []
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    req.cancel()
                    raise APIError(499, "the client disconnected", type="client_closed_request")
                ev = get.result()
                out.append(ev)
                if ev.finish_reason is not None:
                    return out
        finally:
            watch.cancel()
            if not req.done.is_set():
                req.cancel()

    # ---- endpoints -----------------------------------------------------------------------------------------------

    async def chat(self, request: Request):
        self.check_key(request)
        parsed = parse_chat(await self.body(request), self.eos)
        if self.session.tokenizer is None:
            raise bad(f"the model {self.model!r} has no tokenizer.json: chat needs text (use /v1/completions "
                      "with token ids)", param="messages")
        ids = self.prompt_ids(parsed)
        req, events = self.submit(ids, parsed, "messages")
        rid = new_id("chatcmpl")
        split = ReasoningSplitter(parsed.thinking)
        tools = ToolCallParser(parsed.tools)
        if not parsed.stream:
            evs = await self.collect(req, events, request)
            last = evs[-1]
            if last.finish_reason == "error":
                raise APIError(500, f"generation failed: {last.error}", type="server_error")
            reasoning, content = split.feed("".join(e.text for e in evs), final=True)
            content, calls = tools.feed(content, final=True)
            return JSONResponse(chat_response(rid, self.model, reasoning, content, parsed.thinking,
                                              last.finish_reason, last.prompt_tokens, last.completion_tokens,
                                              calls))

        async def body():
            created = now()
            try:
                yield _sse(chat_chunk(rid, created, self.model, {"role": "assistant", "content": ""}, None,
                                      parsed.include_usage))
                while True:
                    ev = await events.get()
                    if ev.finish_reason == "error":
                        yield _sse(APIError(500, f"generation failed: {ev.error}", type="server_error").body())
                        yield "data: [DONE]\n\n"
                        return
                    final = ev.finish_reason is not None
                    reasoning, content = split.feed(ev.text, final=final)
                    if reasoning:
                        yield _sse(chat_chunk(rid, created, self.model, {"reasoning_content": reasoning}, None,
                                              parsed.include_usage))
                    content, calls = tools.feed(content, final=final)
                    if content:
                        yield _sse(chat_chunk(rid, created, self.model, {"content": content}, None,
                                              parsed.include_usage))
                    for n, call in enumerate(calls):  # each call whole, once its block has closed
                        yield _sse(chat_chunk(rid, created, self.model, {"tool_calls": [{"index": n, **call}]},
                                              None, parsed.include_usage))
                    if final:
                        finish = "tool_calls" if tools.calls else ev.finish_reason
                        yield _sse(chat_chunk(rid, created, self.model, {}, finish, parsed.include_usage))
                        if parsed.include_usage:
                            yield _sse(usage_chunk(rid, created, self.model, "chat.completion.chunk",
                                                   ev.prompt_tokens, ev.completion_tokens))
                        yield "data: [DONE]\n\n"
                        return
            finally:
                req.cancel()  # a no-op once finished; frees the row when the client left mid-stream

        return _Stream(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def completions(self, request: Request):
        self.check_key(request)
        parsed = parse_completion(await self.body(request), self.eos)
        ids = self.prompt_ids(parsed)
        req, events = self.submit(ids, parsed, "prompt")
        rid = new_id("cmpl")
        if not parsed.stream:
            evs = await self.collect(req, events, request)
            last = evs[-1]
            if last.finish_reason == "error":
                raise APIError(500, f"generation failed: {last.error}", type="server_error")
            return JSONResponse(completion_response(rid, self.model, "".join(e.text for e in evs),
                                                    last.finish_reason, last.prompt_tokens, last.completion_tokens))

        async def body():
            created = now()
            try:
                while True:
                    ev = await events.get()
                    if ev.finish_reason == "error":
                        yield _sse(APIError(500, f"generation failed: {ev.error}", type="server_error").body())
                        yield "data: [DONE]\n\n"
                        return
                    # one chunk per generated token, its text possibly empty (held back until a UTF-8
                    # character or a stop-string candidate completes): the chunks keep the pace of the tokens
                    if ev.token_id is not None or ev.text:
                        yield _sse(completion_chunk(rid, created, self.model, ev.text, None, parsed.include_usage))
                    if ev.finish_reason is not None:
                        yield _sse(completion_chunk(rid, created, self.model, "", ev.finish_reason,
                                                    parsed.include_usage))
                        if parsed.include_usage:
                            yield _sse(usage_chunk(rid, created, self.model, "text_completion", ev.prompt_tokens,
                                                   ev.completion_tokens))
                        yield "data: [DONE]\n\n"
                        return
            finally:
                req.cancel()

        return _Stream(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def models(self, request: Request):
        self.check_key(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model",
                                                         "created": self.created, "owned_by": "dsv4-ort",
                                                         "max_model_len": self.engine.capacity}]})

    async def health(self, request: Request):
        m = self.engine.metrics()
        return JSONResponse({"status": "ok", "model": self.model, "running": m["running"],
                             "queue_depth": m["queue_depth"], "max_batch": m["max_batch"]})

    async def metrics(self, request: Request):
        return Response(prom.render(self.engine.metrics(), dict(self.http)), media_type=prom.CONTENT_TYPE)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(engine, model_name: str, api_key: str | None = None) -> Starlette:
    """The application; ``app.state.server`` is the :class:`Server` behind it."""
    srv = Server(engine, model_name, api_key)

    def endpoint(fn):
        async def handle(request: Request):
            try:
                response = await fn(request)
            except APIError as e:
                response = error_response(e)
            except Exception as e:  # noqa: BLE001 - no request may take the server down
                msg = " ".join(str(e).split()) or type(e).__name__
                response = error_response(APIError(500, f"internal error: {msg}", type="server_error"))
            srv.http[(request.url.path, response.status_code)] += 1
            return response
        return handle

    async def not_found(request: Request, exc: HTTPException):
        srv.http[("other", exc.status_code)] += 1
        kind = "not found" if exc.status_code == 404 else "method not allowed" if exc.status_code == 405 else \
            exc.detail
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {kind}",
                                       code=str(exc.status_code)))

    routes = [Route("/v1/chat/completions", endpoint(srv.chat), methods=["POST"]),
              Route("/v1/completions", endpoint(srv.completions), methods=["POST"]),
              Route("/v1/models", endpoint(srv.models), methods=["GET"]),
              Route("/health", endpoint(srv.health), methods=["GET"]),
              Route("/metrics", endpoint(srv.metrics), methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found})
    app.state.server = srv
    return app
