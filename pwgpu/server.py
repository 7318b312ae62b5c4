"""The OpenAI-compatible HTTP server (FastAPI): ``/v1/completions``, ``/v1/chat/completions``
(both with SSE streaming), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text).

Errors are JSON ``{"error": {"message", "type", "code"}}`` with these statuses:
400 malformed request or prompt + max_tokens beyond the context; 401 wrong API key; 413 body
or prompt too large; 429 queue full (``max_pending`` requests not finished); 503 engine down.
A client that disconnects (mid-stream or while waiting) has its request aborted, which frees
its KV blocks at the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pwgpu.engine_thread import EngineThread
from pwgpu.sampling import SamplingParams
from pwgpu.tokenizer import IncrementalDecoder, Tokenizer, chat_prompt


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_pending: int = 64  # submitted, unfinished requests before 429
    max_prompt_tokens: int = 2048
    max_tokens_limit: int = 2048  # largest max_tokens accepted
    max_body_bytes: int = 1 << 20


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False  # vLLM's extension: benchmarks ask for exact output lengths


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def first_stop(text: str, delta: str, stops: list[str]) -> int | None:
    """Where in ``text + delta`` the earliest stop string begins, or None. Only the tail that
    ``delta`` can have completed a stop in is searched (``text`` held none), so streaming stays
    linear in the output."""
    if not stops or not delta:
        return None
    full = text + delta
    start = max(len(text) - max(map(len, stops)) + 1, 0)
    cuts = [i for s in stops if s and (i := full.find(s, start)) >= 0]
    return min(cuts) if cuts else None


def build_app(runner: EngineThread, tokenizer: Tokenizer | None, settings: ServerSettings):
    app = FastAPI(title="pwgpu")
    eng = runner.engine
    max_model_len = eng.core.scheduler.config.max_model_len
    # What a replay client records about the server it measured (beside the OpenAI fields).
    server_info = {
        "policy": eng.cfg.policy,
        "budget_bytes": eng.core.pool.total_bytes,
        "page_bytes": eng.page_bytes,
        "device": str(eng.device),
        "importance": eng.table.provenance,
    }

    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return JSONResponse({"error": {"message": e.message, "type": e.kind, "code": e.status}}, status_code=e.status)

    def guard(request: Request) -> None:
        # A plain function called by each /v1 route, not an HTTP middleware: Starlette's
        # BaseHTTPMiddleware hides the client's disconnect from ``request.is_disconnected()``.
        if settings.api_key and request.headers.get("authorization") != f"Bearer {settings.api_key}":
            raise ApiError(401, "missing or wrong API key", "authentication_error")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > settings.max_body_bytes:
            raise ApiError(413, f"body of {size} bytes exceeds {settings.max_body_bytes}")

    @app.get("/health")
    async def health():
        if not runner.alive:
            raise ApiError(503, f"engine is not running: {runner.error}", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        guard(request)
        return {
            "object": "list",
            "data": [{"id": settings.model_name, "object": "model", "created": 0, "owned_by": "pwgpu",
                      "max_model_len": max_model_len, "pwgpu": server_info}],
        }  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(runner.metrics_text(settings.model_name), media_type="text/plain; version=0.0.4")

    async def parse(request: Request, cls):
        guard(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            msg = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
            raise ApiError(400, msg) from None

    def admit(body: _Sampling, prompt_ids: list[int]) -> SamplingParams:
        if body.model not in (None, settings.model_name):
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {settings.model_name!r}",
                           "not_found_error")  # fmt: skip
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty")
        if len(prompt_ids) > settings.max_prompt_tokens:
            raise ApiError(413, f"prompt of {len(prompt_ids)} tokens exceeds the limit of {settings.max_prompt_tokens}")
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        if max_tokens > settings.max_tokens_limit:
            raise ApiError(400, f"max_tokens={max_tokens} exceeds the limit of {settings.max_tokens_limit}")
        if len(prompt_ids) + max_tokens > max_model_len:
            raise ApiError(400, f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds the context "
                                f"of {max_model_len} tokens")  # fmt: skip
        if not runner.alive:
            raise ApiError(503, f"engine is not running: {runner.error}", "server_error")
        if runner.num_pending >= settings.max_pending:
            raise ApiError(429, f"{runner.num_pending} requests in progress; the queue limit is {settings.max_pending}",
                           "rate_limit_error")  # fmt: skip
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                              ignore_eos=body.ignore_eos)  # fmt: skip

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as a list of token ids")
        return tokenizer.encode(text)

    async def generate(request: Request, prompt_ids: list[int], params: SamplingParams, stops: list[str]):
        """Yields (text delta, new ids, finish reason or None) until the request finishes;
        aborts it in the engine if the client goes away first."""
        q, on_event = runner.submit(prompt_ids, params, asyncio.get_running_loop())
        decoder = IncrementalDecoder(tokenizer)
        text, engine_done = "", False
        checked_s = time.monotonic()
        try:
            while True:
                try:
                    er, new_ids, engine_done = await asyncio.wait_for(q.get(), timeout=1.0)
                except TimeoutError:
                    er = None
                # Tokens may flow for minutes to a client that has gone: look at least once a second.
                if er is None or time.monotonic() - checked_s > 1.0:
                    checked_s = time.monotonic()
                    if await request.is_disconnected():
                        return
                if er is None:
                    continue
                if er.finish_reason == "rejected":
                    raise ApiError(400, er.req.reject_reason or "rejected")
                if er.finish_reason == "error":
                    raise ApiError(503, f"engine failed: {runner.error}", "server_error")
                delta = decoder.push(new_ids)
                reason = er.finish_reason if engine_done else None
                cut = first_stop(text, delta, stops)
                if cut is not None:  # a stop string: cut the text before it and end the request
                    delta = (text + delta)[:cut][len(text) :]
                    reason = "stop"
                text += delta
                yield delta, new_ids, reason
                if reason is not None:
                    return
        finally:
            if not engine_done:
                runner.cancel(on_event)

    def stop_list(body: _Sampling) -> list[str]:
        return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])

    async def respond(request: Request, body: _Sampling, prompt_ids: list[int], chat: bool):
        params = admit(body, prompt_ids)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        stream = generate(request, prompt_ids, params, stop_list(body))

        def choice(delta: str, reason: str | None, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
            if body.stream:
                d = {"role": "assistant", "content": delta} if first else {"content": delta}
                return {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            return {"index": 0, "message": {"role": "assistant", "content": delta}, "logprobs": None,
                    "finish_reason": reason}  # fmt: skip

        if body.stream:
            # The first event decides the status code: a rejection is still a 400, not a 200 stream.
            first = await anext(stream, None)

            async def sse():
                item, is_first = first, True
                while item is not None:
                    delta, _, reason = item
                    chunk = {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created,
                             "model": settings.model_name, "choices": [choice(delta, reason, is_first)]}  # fmt: skip
                    yield f"data: {json.dumps(chunk)}\n\n"
                    is_first = False
                    item = await anext(stream, None)
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        text, num_out, reason = "", 0, None
        async for delta, new_ids, r in stream:
            text, num_out, reason = text + delta, num_out + len(new_ids), r or reason
        if reason is None:
            raise ApiError(499, "client disconnected")
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": num_out,
                 "total_tokens": len(prompt_ids) + num_out}  # fmt: skip
        return {"id": rid, "object": obj, "created": created, "model": settings.model_name,
                "choices": [choice(text, reason)], "usage": usage}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        p = body.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise ApiError(400, "only one prompt per request is supported")
            p = p[0]
        return await respond(request, body, encode(p) if isinstance(p, str) else list(p), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        prompt = encode(chat_prompt([m.model_dump() for m in body.messages]))
        return await respond(request, body, prompt, chat=True)

    return app
