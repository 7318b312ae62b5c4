"""The OpenAI-compatible HTTP server (FastAPI): ``/v1/completions``, ``/v1/chat/completions``
(both with SSE streaming), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text, see
``pwgpu.serve_metrics``).

Every error, on every path, is JSON ``{"error": {"message", "type", "param", "code"}}``:
400 malformed request (bad JSON, invalid UTF-8 or a lone UTF-16 surrogate, a field of the wrong
type or out of range, an unknown or unsupported field, prompt + max_tokens beyond the context);
401 wrong API key; 404 unknown path or model; 405 wrong method; 413 body or prompt too large;
429 queue full (``max_pending`` requests not finished); 503 engine down.

The event loop only moves bytes: reading the body (counted as it arrives, so a chunked body
cannot exceed the limit either), JSON parsing and validation, tokenization and detokenization
run on a small worker pool. A prompt whose size alone shows it cannot fit is refused before it
is tokenized. A client that disconnects (mid-stream or while waiting) has its request aborted,
which frees its KV blocks at the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pwgpu.engine_thread import EngineThread
from pwgpu.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs
from pwgpu.serve_metrics import RequestTiming, ServerMetrics
from pwgpu.tokenizer import IncrementalDecoder, Tokenizer, chat_prompt

MAX_N = 16  # choices per request
# How often a request whose tokens keep coming looks whether its client is still there: an
# abort frees the request's KV about this long after the client left (a check is an await
# on the connection's receive channel, microseconds).
DISCONNECT_CHECK_S = 0.25
# JSON has no -inf; a token the model gives no chance gets this (as vLLM reports it).
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_pending: int = 64  # submitted, unfinished engine requests (n counts n) before 429
    max_prompt_tokens: int = 2048
    max_tokens_limit: int = 2048  # largest max_tokens accepted
    max_body_bytes: int = 1 << 20
    # Text prompts of more UTF-8 bytes are refused before tokenizing (None: from the tokenizer,
    # the most bytes ``max_prompt_tokens`` tokens can stand for, twice over for normalizers).
    max_prompt_bytes: int | None = None
    num_workers: int = 2  # threads for parsing, tokenizing and detokenizing


# ---- request bodies ---------------------------------------------------------------------------
class _Strict(BaseModel):
    # Strict: "5" is not an int nor "yes" a bool. Unknown fields are errors, never ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage in every chunk


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extension; -1 or 0: all tokens
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's extension
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # vLLM's extension
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's extension
    ignore_eos: bool | None = False  # vLLM's extension: benchmarks ask for exact output lengths
    return_tokens_as_token_ids: bool | None = False  # vLLM's extension: log-probability tokens as "token_id:N"
    user: str | None = None  # informational
    # OpenAI fields this server cannot honour: accepted only at their no-op values (see admit).
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


_UNION_TAGS = ("str", "int", "float", "bool", "dict", "list", "none")


def _split_union(loc) -> tuple[str, str | None]:
    """(field path, the union member pydantic tried or None): pydantic puts the member's type
    ("str", "list[int]") in the location; the client only named the field."""
    parts = []
    for p in loc:
        if isinstance(p, str) and ("[" in p or p in _UNION_TAGS or p.startswith("function-")):
            return ".".join(parts) or "body", p
        parts.append(str(p))
    return ".".join(parts) or "body", None


def _validation_message(e: ValidationError) -> tuple[str, str]:
    """One line naming each wrong field once, and the first field's name."""
    seen: dict[str, str] = {}
    unions: dict[str, list[str]] = {}
    for err in e.errors():
        path, member = _split_union(err["loc"])
        if member is not None:
            unions.setdefault(path, []).append(member)
            seen.setdefault(path, "")
        elif err["type"] == "extra_forbidden":
            seen.setdefault(path, "unknown field (not supported by this server)")
        else:
            seen.setdefault(path, err["msg"])
    for path, members in unions.items():
        seen[path] = "wrong type; expected one of " + ", ".join(dict.fromkeys(members))
    first = next(iter(seen))
    return "; ".join(f"{p}: {m}" for p, m in list(seen.items())[:4]), first


def _lone_surrogate(value, path: str = "") -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate (JSON "\\ud800" escapes
    decode to one; no tokenizer can take it, nor can it be written back as UTF-8), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for k, v in value.items():
            if _lone_surrogate(k):
                return f"a key of {path or 'the body'}"
            if bad := _lone_surrogate(v, f"{path}.{k}" if path else k):
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if bad := _lone_surrogate(v, f"{path}.{i}" if path else str(i)):
                return bad
    return None


def parse_body(raw: bytes, cls: type[_Strict]) -> _Strict:
    """Bytes of a request body -> the validated request, or a 400 naming what is wrong (worker
    thread: a large body takes a while to parse)."""
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, not {type(body).__name__}")
    if bad := _lone_surrogate(body):
        raise ApiError(400, f"{bad}: contains a lone UTF-16 surrogate; strings must be valid Unicode", param=bad)
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        message, param = _validation_message(e)
        raise ApiError(400, message, param=param) from None


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


# ---- one engine request's output ----------------------------------------------------------------
@dataclass
class Piece:
    """What one choice produced since its last piece."""

    text: str
    token_ids: list[int]
    # (values, (token text, its bytes), [(text, bytes) of each top token]) per token
    logprobs: list[tuple[TokenLogprobs, tuple[str, bytes], list[tuple[str, bytes]]]] | None
    finish_reason: str | None = None


@dataclass
class Choice:
    """The state of one choice (one engine request) while it is generated."""

    index: int
    params: SamplingParams
    stops: list[str]
    timing: RequestTiming
    tokens_as_ids: bool = False
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    last_token_s: float | None = None


def build_app(runner: EngineThread, tokenizer: Tokenizer | None, settings: ServerSettings):
    app = FastAPI(title="pwgpu")
    eng = runner.engine
    metrics = ServerMetrics(settings.model_name)
    pool = ThreadPoolExecutor(settings.num_workers, thread_name_prefix="pwgpu-tok")
    app.state.metrics, app.state.pool = metrics, pool
    max_model_len = eng.core.scheduler.config.max_model_len
    max_prompt_bytes = settings.max_prompt_bytes
    if max_prompt_bytes is None and tokenizer is not None:
        max_prompt_bytes = 2 * settings.max_prompt_tokens * tokenizer.max_token_bytes
    # What a replay client records about the server it measured (beside the OpenAI fields).
    server_info = {
        "policy": eng.cfg.policy,
        "budget_bytes": eng.core.pool.total_bytes,
        "page_bytes": eng.page_bytes,
        "device": str(eng.device),
        "importance": eng.table.provenance,
    }

    async def off_loop(fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def error_response(status: int, message: str, kind: str, param: str | None = None) -> Response:
        metrics.refuse(status)
        # ASCII JSON: a message may quote text that is not valid UTF-8 on its own.
        body = json.dumps(error_body(status, message, kind, param))
        return Response(body, status_code=status, media_type="application/json")

    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return error_response(e.status, e.message, e.kind, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        resp = error_response(e.status_code, message.get(e.status_code, str(e.detail)), kind)
        if e.headers:
            resp.headers.update(e.headers)
        return resp

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, e: RequestValidationError):
        return error_response(400, str(e), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal_error(_request, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    def guard(request: Request) -> None:
        # A plain function called by each /v1 route, not an HTTP middleware: Starlette's
        # BaseHTTPMiddleware hides the client's disconnect from ``request.is_disconnected()``.
        if settings.api_key and request.headers.get("authorization") != f"Bearer {settings.api_key}":
            raise ApiError(401, "missing or wrong API key", "authentication_error")

    async def read_body(request: Request) -> bytes:
        """The body, counted as it arrives: a chunked body (no Content-Length) is cut off at the
        limit too, before it is all in memory."""
        limit = settings.max_body_bytes
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > limit):
            raise ApiError(413, f"body of {size} bytes exceeds the limit of {limit}")
        chunks, total = [], 0
        try:
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise ApiError(413, f"body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "client disconnected while sending the body") from None
        return b"".join(chunks)

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
    async def metrics_endpoint():
        return PlainTextResponse(metrics.render(eng), media_type="text/plain; version=0.0.4")

    async def parse(request: Request, cls):
        guard(request)
        raw = await read_body(request)
        return await off_loop(parse_body, raw, cls)

    def check_text_size(text: str) -> None:
        size = len(text.encode("utf-8"))
        if max_prompt_bytes is not None and size > max_prompt_bytes:
            raise ApiError(413, f"prompt of {size} bytes cannot fit in {settings.max_prompt_tokens} tokens (at most "
                                f"{max_prompt_bytes} bytes of text are tokenized)", param="prompt")  # fmt: skip

    async def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        check_text_size(text)
        return await off_loop(tokenizer.encode, text)

    def sampling_params(body: _Sampling, prompt_ids: list[int], num_logprobs: int | None) -> SamplingParams:
        """The request's sampling settings, or a 400/404/413/429/503 naming what is wrong."""
        if body.model not in (None, settings.model_name):
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {settings.model_name!r}",
                           "not_found_error", "model")  # fmt: skip
        n = body.n or 1
        if body.logit_bias:
            raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias")
        if body.best_of not in (None, n):
            raise ApiError(400, f"best_of={body.best_of} is not supported (only best_of = n)", param="best_of")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(prompt_ids) > settings.max_prompt_tokens:
            raise ApiError(413, f"prompt of {len(prompt_ids)} tokens exceeds the limit of {settings.max_prompt_tokens}",
                           param="prompt")  # fmt: skip
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        if max_tokens > settings.max_tokens_limit:
            raise ApiError(400, f"{name}={max_tokens} exceeds the limit of {settings.max_tokens_limit}", param=name)
        if len(prompt_ids) + max_tokens > max_model_len:
            raise ApiError(400, f"prompt ({len(prompt_ids)}) + {name} ({max_tokens}) exceeds the context "
                                f"of {max_model_len} tokens", param=name)  # fmt: skip
        if (body.min_tokens or 0) > max_tokens:
            raise ApiError(400, f"min_tokens={body.min_tokens} exceeds {name}={max_tokens}", param="min_tokens")
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(body.top_k or 0, 0),
                min_p=body.min_p or 0.0,
                seed=body.seed,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=bool(body.ignore_eos),
                min_tokens=body.min_tokens or 0,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logprobs=num_logprobs,
            )
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        if not runner.alive:
            raise ApiError(503, f"engine is not running: {runner.error}", "server_error")
        if runner.num_pending + n > settings.max_pending:
            raise ApiError(429, f"{runner.num_pending} requests in progress; the queue limit is {settings.max_pending}",
                           "rate_limit_error")  # fmt: skip
        return params

    def token_of(token_id: int, as_id: bool) -> tuple[str, bytes]:
        if tokenizer is None or as_id:  # asked for, or a model without a tokenizer
            name = f"token_id:{token_id}"
            return name, name.encode() if tokenizer is None else tokenizer.token_bytes(token_id)
        return tokenizer.token_text(token_id), tokenizer.token_bytes(token_id)

    def decode_events(decoder: IncrementalDecoder, events: list[tuple], as_ids: bool) -> list[tuple]:
        """Worker thread: for each event (new ids, their log-probabilities, finished), the text of
        the new tokens (all that is left when finished) and, with log-probabilities, each
        token's text (or ``token_id:N`` when ``as_ids``) and bytes."""
        out = []
        for ids, lps, done in events:
            delta = decoder.push(ids) + (decoder.flush() if done else "")
            if lps is None:
                out.append((delta, None))
            else:
                out.append((delta, [(lp, token_of(lp.token_id, as_ids), [token_of(t, as_ids) for t, _ in lp.top])
                                    for lp in lps]))  # fmt: skip
        return out

    async def generate(request: Request, prompt_ids: list[int], c: Choice) -> AsyncIterator[Piece]:
        """Pieces of one choice until it finishes; aborts it in the engine if the client goes
        away first. Counts the request in the metrics exactly once, however it ends."""
        q, on_event = runner.submit(prompt_ids, c.params, asyncio.get_running_loop(), c.timing.arrival_s)
        decoder = IncrementalDecoder(tokenizer)
        engine_done, er = False, None
        checked_s = time.monotonic()
        try:
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), timeout=DISCONNECT_CHECK_S)
                except TimeoutError:
                    item = None
                # Tokens may flow for minutes to a client that has gone: look every
                # DISCONNECT_CHECK_S while they do.
                if item is None or time.monotonic() - checked_s > DISCONNECT_CHECK_S:
                    checked_s = time.monotonic()
                    if await request.is_disconnected():
                        return
                if item is None:
                    continue
                # Every event already queued is decoded in one trip to the pool, and still
                # handed out as one piece each (clients time tokens by chunks).
                er, engine_done, events = item[0], item[3], [item[1:]]
                while not engine_done and not q.empty():
                    more = q.get_nowait()
                    events.append(more[1:])
                    engine_done = more[3]
                if er.finish_reason == "rejected":
                    raise ApiError(400, er.req.reject_reason or "rejected")
                if er.finish_reason == "error":
                    raise ApiError(503, f"engine failed: {runner.error}", "server_error")
                decoded = await off_loop(decode_events, decoder, events, c.tokens_as_ids)
                now = eng.now()
                for (ids, _, done), (delta, lp_texts) in zip(events, decoded, strict=True):
                    reason = er.finish_reason if done else None
                    if ids:
                        if c.num_tokens == 0:
                            c.timing.first_token_s = now
                            metrics.first_token(c.timing)
                            if len(ids) > 1:
                                metrics.token_gap(0.0, len(ids) - 1)
                        else:
                            metrics.token_gap(now - c.last_token_s, len(ids))
                        c.last_token_s = now
                        c.num_tokens += len(ids)
                    if c.num_tokens >= c.params.min_tokens:
                        cut = first_stop(c.text, delta, c.stops)
                        if cut is not None:  # a stop string: cut the text before it and end the request
                            delta = (c.text + delta)[:cut][len(c.text) :]
                            reason = "stop"
                    c.text += delta
                    if reason is not None:
                        c.finish_reason = reason
                    yield Piece(delta, ids, lp_texts, reason)
                    if reason is not None:
                        return
        finally:
            if not engine_done:
                runner.cancel(on_event)
            t = c.timing
            t.end_s = eng.now()
            if er is not None and er.finish_reason not in ("rejected", "error"):
                t.finish_reason = c.finish_reason or "abort"
                t.output_tokens = c.num_tokens
                t.scheduled_s = er.req.first_scheduled_s
                t.engine_first_token_s = er.req.first_token_s
                times = er.req.token_times_s
                t.engine_last_token_s = times[-1] if times else None
                metrics.finish(t)
            elif er is None:  # gone before the engine said anything: aborted while queued
                t.finish_reason, t.output_tokens = "abort", 0
                metrics.finish(t)

    async def merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
        """The pieces of every choice, as they come."""
        if len(streams) == 1:
            try:
                async for p in streams[0]:
                    yield 0, p
            finally:  # close the choice now (its cleanup aborts it), not whenever it is collected
                await streams[0].aclose()
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: AsyncIterator[Piece]) -> None:
            try:
                async for p in s:
                    q.put_nowait((i, p))
            except Exception as e:
                q.put_nowait((i, e))
            finally:
                q.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            live = len(tasks)
            while live:
                i, item = await q.get()
                if item is None:
                    live -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:  # each choice's own cleanup aborts it in the engine
                task.cancel()

    def completion_logprobs(entries, offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp, (tok, _), top_tokens in entries:
            tokens.append(tok)
            token_lps.append(max(lp.logprob, MIN_LOGPROB))
            top = {t: max(v, MIN_LOGPROB) for (t, _), (_, v) in zip(top_tokens, lp.top, strict=True)}
            top.setdefault(tok, max(lp.logprob, MIN_LOGPROB))
            tops.append(top)
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(entries) -> dict:
        def one(token: tuple[str, bytes], v: float) -> dict:
            return {"token": token[0], "logprob": max(v, MIN_LOGPROB), "bytes": list(token[1])}

        content = []
        for lp, token, top_tokens in entries:
            d = one(token, lp.logprob)
            d["top_logprobs"] = [one(t, v) for t, (_, v) in zip(top_tokens, lp.top, strict=True)]
            content.append(d)
        return {"content": content}

    async def respond(request: Request, body: _Sampling, prompt_ids: list[int], arrival_s: float, chat: bool,
                      num_logprobs: int | None, echo_text: str = ""):  # fmt: skip
        params = sampling_params(body, prompt_ids, num_logprobs)
        n = body.n or 1
        metrics.n_hist.observe(n)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        choices = []
        for i in range(n):
            # As in vLLM: with a seed, choice i draws from seed + i, so the choices differ.
            p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            timing = RequestTiming("abort", arrival_s, arrival_s, len(prompt_ids), 0, params.max_tokens)
            choices.append(Choice(i, p, stops, timing, bool(body.return_tokens_as_token_ids)))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        stream = merged([generate(request, prompt_ids, c) for c in choices])
        opts = body.stream_options or StreamOptions()

        def usage() -> dict:
            out = sum(c.num_tokens for c in choices)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": out, "total_tokens": len(prompt_ids) + out}

        def logprobs_of(entries, offset: int):
            if num_logprobs is None:
                return None
            return chat_logprobs(entries or []) if chat else completion_logprobs(entries or [], offset)

        if body.stream:
            # The first piece decides the status code: a rejection is still a 400, not a 200 stream.
            first = await anext(stream, None)

            async def sse():
                item, started = first, set()
                offsets = [len(echo_text)] * n
                try:
                    while item is not None:
                        i, piece = item
                        if chat:
                            delta = {"content": piece.text}
                            if i not in started:
                                delta = {"role": "assistant", "content": piece.text}
                            ch = {"index": i, "delta": delta, "logprobs": logprobs_of(piece.logprobs, 0),
                                  "finish_reason": piece.finish_reason}  # fmt: skip
                        else:
                            text = piece.text if i in started or not echo_text else echo_text + piece.text
                            ch = {"index": i, "text": text, "logprobs": logprobs_of(piece.logprobs, offsets[i]),
                                  "finish_reason": piece.finish_reason}  # fmt: skip
                            offsets[i] += len(text)
                        started.add(i)
                        chunk = {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created,
                                 "model": settings.model_name, "choices": [ch]}  # fmt: skip
                        if opts.include_usage:
                            chunk["usage"] = usage() if opts.continuous_usage_stats else None
                        yield f"data: {json.dumps(chunk)}\n\n"
                        item = await anext(stream, None)
                    if opts.include_usage:
                        chunk = {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created,
                                 "model": settings.model_name, "choices": [], "usage": usage()}  # fmt: skip
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    await stream.aclose()

            return StreamingResponse(sse(), media_type="text/event-stream")
        entries: list[list] = [[] for _ in range(n)]
        try:
            async for i, piece in stream:
                if piece.logprobs:
                    entries[i].extend(piece.logprobs)
        finally:
            await stream.aclose()
        if any(c.finish_reason is None for c in choices):
            raise ApiError(499, "client disconnected")
        out = []
        for c in choices:
            if chat:
                message = {"role": "assistant", "content": c.text}
                out.append({"index": c.index, "message": message, "logprobs": logprobs_of(entries[c.index], 0),
                            "finish_reason": c.finish_reason})  # fmt: skip
            else:
                out.append({"index": c.index, "text": echo_text + c.text,
                            "logprobs": logprobs_of(entries[c.index], len(echo_text)),
                            "finish_reason": c.finish_reason})  # fmt: skip
        return {"id": rid, "object": obj, "created": created, "model": settings.model_name, "choices": out,
                "usage": usage()}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival_s = eng.now()
        body = await parse(request, CompletionRequest)
        if body.suffix:
            raise ApiError(400, "suffix is not supported by this server", param="suffix")
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs needs the prompt's log-probabilities, which this server does not "
                                "compute", param="echo")  # fmt: skip
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, "only one prompt per request is supported (use n for several choices)",
                               param="prompt")  # fmt: skip
            p = p[0]
        ids = await encode(p) if isinstance(p, str) else list(p)
        echo_text = ""
        if body.echo:
            echo_text = p if isinstance(p, str) else (await off_loop(tokenizer.decode, ids) if tokenizer else "")
        return await respond(request, body, ids, arrival_s, False, body.logprobs, echo_text)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival_s = eng.now()
        body = await parse(request, ChatRequest)
        if body.tools or body.tool_choice not in (None, "none"):
            raise ApiError(400, "tools are not supported by this server", param="tools")
        if body.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "response_format other than text is not supported", param="response_format")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        messages = []
        for i, m in enumerate(body.messages):
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    where = f"messages.{i}.content.{j}"
                    if part.get("type") != "text" or not isinstance(part.get("text"), str) or len(part) != 2:
                        raise ApiError(400, f"{where}: only text parts {{'type': 'text', 'text': str}} are supported",
                                       param=where)  # fmt: skip
            messages.append({"role": m.role, "content": m.content})
        text = chat_prompt(messages)
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await respond(request, body, await encode(text), arrival_s, True, num_logprobs)

    return app
