"""The routes of the OpenAI-compatible HTTP API (FastAPI)::

    POST /v1/completions        prompt (string, token ids, or a list of either: one choice per prompt)
    POST /v1/chat/completions   messages, rendered by the chat template (model/chat_template.py); with tools,
                                the answer's calls as tool_calls (--tool-call-parser, model/tool_calls.py)
    POST /v1/responses          OpenAI's Responses API, run as the chat request it amounts to
                                (router/http/responses.py; its events: router/http/response_events.py)
    POST /v1/messages           Anthropic's Messages API, the same way (router/http/anthropic.py, its events:
                                router/http/anthropic_events.py; errors in its shape, the key as x-api-key too)
    GET  /v1/models             the served model          GET /health    200 once workers of every role are listed
    GET  /metrics               the router's Prometheus registry
    POST /tokenize              vLLM's: a prompt's or a conversation's token ids, their count, the context
    POST /detokenize            vLLM's: the text of token ids

A request takes the router's own path (:meth:`Backend.generate`, which the gRPC servicer calls too:
the same stream slots, validation, messages and ``run_generate``), never a gRPC loopback. Streams are
server-sent events (``sse-starlette``) in OpenAI's chunk format, ending with ``data: [DONE]``; an error
after the first chunk is sent as an ``{"error": ...}`` event and the stream ends without ``[DONE]``.
``/v1/*``, ``/tokenize`` and ``/detokenize`` need the router's bearer token when it has one (:class:`Guard`);
``/health`` and ``/metrics`` stay open, as the gRPC health service does.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.rpc_fields import outside_vocabulary
from pdserve.model.chat_template import ChatTemplate
from pdserve.model.config import ModelConfig
from pdserve.model.reasoning import END, START, grammar_start
from pdserve.model.tokenizer import Tokenizer
from pdserve.proto import pdserve_pb2
from pdserve.router.config import RouterConfig
from pdserve.router.http import anthropic
from pdserve.router.http.anthropic import MessagesRequest
from pdserve.router.http.anthropic_events import MessageEvents
from pdserve.router.http.chat import chat_prompt, encode_prompt, tokenize_body
from pdserve.router.http.errors import ANTHROPIC_PATHS, ApiError, from_status, install_handlers
from pdserve.router.http.mapping import check_supported, generate_request, prompts_of, tool_parser_for
from pdserve.router.http.reply import Reply
from pdserve.router.http.response_events import ResponseEvents
from pdserve.router.http.responses import chat_body, new_id, now, whole_response
from pdserve.router.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    SamplingBody,
    TokenizeRequest,
)
from pdserve.router.http.streams import ChoiceStreams, ClientGone, EventWriter, collect, typed_events
from pdserve.router.recovery import GenerateError

MAX_PROMPTS = 128  # prompts of one completions request (each is a stream of its own)
HOLDS_MARKERS = ("hermes", "granite", "mistral", "pythonic")   # parsers whose markers tokenizers may mark special
LONG_IDS = 4096   # token ids /detokenize decodes on a worker thread beyond
GUARDED = ("/tokenize", "/detokenize")   # outside /v1/, behind the bearer token and the body limit too


class Backend(Protocol):
    """What the HTTP API needs of the router (:class:`router.server.Router`)."""

    cfg: RouterConfig
    model_cfg: ModelConfig
    tokenizer: Tokenizer
    workers: list[WorkerInfo]
    metrics: CollectorRegistry

    def generate(self, parsed: pdserve_pb2.GenerateRequest, deadline: float | None = None,
                 metadata: Iterable[tuple[str, str | bytes]] = ()) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        ...


class Guard:
    """ASGI middleware in front of the routes: under ``/v1/``, the bearer token (401 in OpenAI's shape,
    before the body is read) and the body size (413 beyond ``max_body_bytes``, declared or streamed). On
    Anthropic's paths an ``x-api-key`` header (what its SDKs send) stands for ``Authorization: Bearer <key>``, here
    and for the routes behind (the request's headers are rewritten so)."""

    def __init__(self, app: ASGIApp, tokens: Sequence[str], max_body_bytes: int) -> None:
        self.app, self._tokens, self._max = app, [t.encode() for t in tokens], max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] in GUARDED):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", ())}
        anthropic = scope["path"] in ANTHROPIC_PATHS
        if anthropic and "x-api-key" in headers:
            headers["authorization"] = b"Bearer " + headers["x-api-key"]
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"authorization"]
                     + [(b"authorization", headers["authorization"])]}
        error = self._check_token(headers.get("authorization"))
        if error is not None:
            return await ApiError(401, error, code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"}).response(anthropic)(scope, receive, send)
        declared = headers.get("content-length", b"0")
        if not declared.isdigit() or int(declared) > self._max:
            return await self._too_large().response(anthropic)(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self._max:
                raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited, send)

    def _check_token(self, header: bytes | None) -> str | None:
        if not self._tokens:
            return None
        if header is None:
            return "missing 'Authorization: Bearer <token>' header"
        scheme, _, token = header.strip().partition(b" ")
        matches = [hmac.compare_digest(token.strip(), t) for t in self._tokens]  # all compared: no early exit
        return None if scheme.lower() == b"bearer" and any(matches) else "invalid bearer token"

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body larger than {self._max} bytes (max_receive_message_bytes)")


def make_app(backend: Backend, model_name: str, chat_template: ChatTemplate | None) -> ASGIApp:
    """The application of ``backend`` serving ``model_name``: the FastAPI routes (see the module
    docstring) behind :class:`Guard`."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    started = int(time.time())
    thinking_marks = ((backend.tokenizer.encode(START, False), backend.tokenizer.encode(END, False))
                      if backend.cfg.reasoning_parser else None)     # where a reasoning model's grammar may start

    def check_model(body: SamplingBody | TokenizeRequest | DetokenizeRequest) -> None:
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"the model `{body.model}` does not exist (this router serves `{model_name}`)",
                           param="model", code="model_not_found")
        if isinstance(body, SamplingBody):
            check_supported(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body)
        prompts = prompts_of(body.prompt)
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"{len(prompts)} prompts in one request; at most {MAX_PROMPTS}", param="prompt")
        reply = Reply(False, model_name, bool(body.return_token_ids), body.n or 1, body.logprobs is not None,
                      echo=[_prompt_text(p, backend) for p in prompts] if body.echo else None,
                      prompt_logprobs=body.prompt_logprobs is not None)
        if not body.add_special_tokens:   # text prompts tokenized here, without the special tokens the router adds
            prompts = [await encode_prompt(p, backend, False) if isinstance(p, str) else p for p in prompts]
        return await _answer(backend, request, body, reply, [
            generate_request(body, p, f"{reply.id}-{i}") for i, p in enumerate(prompts)])

    async def chat_call(body: ChatCompletionRequest) -> tuple[pdserve_pb2.GenerateRequest, Reply]:
        """A chat body's request and the reply that reads its answer (reasoning, content, tool calls)."""
        if chat_template is None:
            raise ApiError(400, f"the model `{model_name}` has no chat template (none in its tokenizer_config.json "
                                "or chat_template.jinja): use /v1/completions, or start the router with "
                                "--chat-template FILE", param="messages", code="no_chat_template")
        parser = tool_parser_for(body, backend.cfg.tool_call_parser)
        ids, room = await chat_prompt(chat_template, body.messages, backend, body.add_generation_prompt, body.tools,
                                      body.chat_template_kwargs, body.continue_final_message, body.reasoning_effort)
        req = generate_request(body, ids, "", room)
        thinking = backend.cfg.reasoning_parser
        if thinking and req.sampling.HasField("structured_output"):   # the grammar starts after the reasoning
            after = grammar_start(*thinking_marks, ids)
            if after is None:
                thinking = ""    # the prompt closed the reasoning: the grammar holds the whole answer
            else:
                req.sampling.structured_output.start_after.extend(after)
        reply = Reply(True, model_name, bool(body.return_token_ids), body.n or 1, bool(body.logprobs), parser,
                      body.parallel_tool_calls is not False, reasoning_parser=thinking,
                      prompt_logprobs=body.prompt_logprobs is not None)
        req.request_id = reply.id
        if (parser in HOLDS_MARKERS or thinking) and body.skip_special_tokens is None:
            req.sampling.skip_special_tokens = False   # its markers may be special tokens (vLLM does the same)
        return req, reply

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body)
        req, reply = await chat_call(body)
        return await _answer(backend, request, body, reply, [req])

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        chat = chat_body(body)
        check_model(chat)
        req, reply = await chat_call(chat)
        response_id, created = new_id("resp"), now()
        req.request_id = response_id
        return await _one_choice(backend, request, req, reply, bool(body.stream),
                                 lambda whole: whole_response(response_id, body, reply.model, created, whole),
                                 ResponseEvents(body, reply.model, response_id, created))

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        chat = anthropic.chat_body(body)
        check_model(chat)
        req, reply = await chat_call(chat)
        message_id = req.request_id = anthropic.new_id()
        return await _one_choice(backend, request, req, reply, bool(body.stream),
                                 lambda whole: anthropic.whole_message(message_id, reply.model, whole),
                                 MessageEvents(reply.model, message_id))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body)
        return await tokenize_body(body, backend, chat_template)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body)
        context = backend.model_cfg.max_model_len
        if len(body.tokens) > context:
            raise ApiError(400, f"{len(body.tokens)} tokens exceed the model's context of {context}", param="tokens")
        bad = outside_vocabulary(body.tokens, backend.model_cfg.vocab_size)
        if bad:
            raise ApiError(400, f"token ids {bad[:8]} are outside the vocabulary [0, {backend.model_cfg.vocab_size})",
                           param="tokens")
        if len(body.tokens) > LONG_IDS:     # off the event loop, as long chat prompts are tokenized
            return {"prompt": await anyio.to_thread.run_sync(backend.tokenizer.decode, body.tokens)}
        return {"prompt": backend.tokenizer.decode(body.tokens)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(model_name, started, backend)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        if name != model_name:
            raise ApiError(404, f"the model `{name}` does not exist", param="model", code="model_not_found")
        return _model_card(model_name, started, backend)

    @app.get("/health")
    async def health() -> JSONResponse:
        roles = {w.role for w in backend.workers}
        ready = "both" in roles or {"prefill", "decode"} <= roles
        counts = {role: sum(w.role == role for w in backend.workers) for role in ("prefill", "decode", "both")}
        return JSONResponse({"status": "ok" if ready else "no workers", "workers": counts},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(backend.metrics), media_type=CONTENT_TYPE_LATEST)

    return Guard(app, backend.cfg.bearer_tokens(), backend.cfg.max_receive_message_bytes)


def _prompt_text(prompt: str | list[int], backend: Backend) -> str:
    """A completions prompt's text, for ``echo``: token ids decoded ("" for ids outside the vocabulary: the
    router refuses that prompt by name before any text goes out)."""
    if isinstance(prompt, str):
        return prompt
    return "" if outside_vocabulary(prompt, backend.model_cfg.vocab_size) else backend.tokenizer.decode(prompt)


def _model_card(name: str, created: int, backend: Backend) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "pdserve",
            "max_model_len": backend.model_cfg.max_model_len}


async def _answer(backend: Backend, request: Request, body: SamplingBody, reply: Reply,
                  requests: list[pdserve_pb2.GenerateRequest]) -> Response:
    """Run ``requests`` (one per choice) on the router and answer: JSON, or an event stream."""
    streams = _streams(backend, request, requests)
    try:
        if not body.stream:
            return JSONResponse(reply.response(await collect(streams, len(requests), _disconnect_of(request),
                                                             reply.n)))
        firsts = await streams.first()  # refusals become HTTP statuses, before any byte of the stream
    except GenerateError as exc:
        raise from_status(exc.code, exc.message) from None
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options.continuous_usage_stats)
    return EventSourceResponse(_events(streams, firsts, reply, include_usage, continuous), ping=15,
                               client_close_handler_callable=lambda message: _close(streams))


def _streams(backend: Backend, request: Request, requests: list[pdserve_pb2.GenerateRequest]) -> ChoiceStreams:
    """The choices of ``requests`` on the router's own path, with the client's bearer token (:class:`Guard` has
    made an Anthropic client's ``x-api-key`` one)."""
    auth = request.headers.get("authorization")
    metadata = [("authorization", auth)] if auth is not None else []
    return ChoiceStreams([backend.generate(r, None, metadata) for r in requests])


async def _one_choice(backend: Backend, request: Request, req: pdserve_pb2.GenerateRequest, reply: Reply,
                      stream: bool, whole: Callable[[dict], dict], writer: EventWriter) -> Response:
    """Run a request of one choice (the Responses and Messages APIs, read as chat requests) and answer:
    ``whole(the chat completion body reply makes)`` as JSON, or ``writer``'s server-sent events
    (:func:`router.http.streams.typed_events`)."""
    streams = _streams(backend, request, [req])
    try:
        if not stream:
            return JSONResponse(whole(reply.response(await collect(streams, 1, _disconnect_of(request)))))
        first, = await streams.first()
    except GenerateError as exc:
        raise from_status(exc.code, exc.message) from None
    except ClientGone:
        return Response(status_code=499)
    return EventSourceResponse(typed_events(streams, first, reply, writer), ping=15,
                               client_close_handler_callable=lambda message: _close(streams))


async def _events(streams: ChoiceStreams, firsts: list[pdserve_pb2.GenerateResponse], reply: Reply,
                  include_usage: bool, continuous: bool = False) -> AsyncIterator[str]:
    """The SSE ``data`` of a streamed answer; closing it (client gone) cancels the choices. ``continuous``
    (vLLM's ``continuous_usage_stats``): every chunk carries its choice's usage so far."""
    finals: list[pdserve_pb2.Final | None] = [None] * (len(firsts) * reply.n)
    started: set[int] = set()
    prompt_tokens = [m.prompt_tokens for m in firsts]            # per prompt (each first message carries it)
    completion_tokens = [0] * len(finals)

    def dump(chunk: dict, index: int) -> str:
        if continuous:
            p, c = prompt_tokens[index // reply.n], completion_tokens[index]
            chunk["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        return json.dumps(chunk)

    def chunks(stream: int, msg: pdserve_pb2.GenerateResponse) -> Iterable[str]:
        index = stream * reply.n + msg.index  # a prompt's n sequences are n choices
        completion_tokens[index] += len(msg.token_ids)
        # reasoning and tool calls split off
        reasoning, text, calls = reply.stream_text(index, msg.text, end=msg.HasField("final"))
        if index not in started:       # a choice's first message: its echoed prompt first
            started.add(index)
            text = reply.echo_text(index) + text
        if text or calls or reasoning or (msg.token_ids and (reply.return_token_ids or reply.logprobs)):
            yield dump(reply.chunk(index, text, msg.token_ids, logprobs=msg.logprobs, tool_calls=calls,
                                   prompt_logprobs=msg.prompt_logprobs, reasoning=reasoning), index)
        if msg.HasField("final"):
            finals[index] = msg.final
            yield dump(reply.chunk(index, "" if not reply.chat else None, (), msg.final), index)

    try:
        if reply.chat:
            for index in range(len(finals)):
                yield dump(reply.chunk(index, "", (), role=True), index)
        for index, msg in enumerate(firsts):
            for data in chunks(index, msg):
                yield data
        async for index, msg in streams.rest():
            for data in chunks(index, msg):
                yield data
        if include_usage:
            yield json.dumps(reply.usage_chunk(finals))
        yield "[DONE]"
    except GenerateError as exc:  # after the first token: an error event, never a silently short answer
        yield json.dumps(from_status(exc.code, exc.message).body())
    finally:
        await _close(streams)


async def _close(streams: ChoiceStreams) -> None:
    with anyio.CancelScope(shield=True):  # runs while the response's task group is being cancelled
        await streams.aclose()


def _disconnect_of(request: Request):
    """A coroutine function that returns once the client of ``request`` (body already read) disconnects."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    return disconnected
