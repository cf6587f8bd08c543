"""ASGI middleware (``--middleware vllm_kvcomp.server.middleware.KVCompressionMiddleware``).

Every POST with a body it can read is checked here, before vLLM sees it. On a route of
:data:`protocol.ROUTES` (the routes whose requests reach the engine with ``SamplingParams``) it
buffers the JSON body, resolves the request's one compression spec through the operator config
(protocol.py) and forwards the body with the resolved ``kvcomp_*`` keys in the place that route
reads, or answers HTTP 400 itself so that nothing reaches the engine. Successful responses get
``X-KV-Compression-Applied`` and, where the route reports usage, ``usage.kv_compression`` (in a
stream: on the final chunk). Every other POST route refuses compression settings instead of
ignoring them. A JSON body that cannot be parsed (syntax, nesting deeper than
``protocol.MAX_JSON_DEPTH``, an integer too long to convert), or that is not an object on a
route outside :data:`protocol.ROUTES`, is answered with a 400 here.

The operator config is the ``--kv-compression-config`` value that ``vllm-kvcomp serve`` adds to
vLLM's arguments (``app.state.args``); without it every request gets the default config.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from vllm_kvcomp.engine.support import unavailable_reason
from vllm_kvcomp.server import protocol
from vllm_kvcomp.server.context import ContextCounter
from vllm_kvcomp.server.operator_config import OperatorConfig
from vllm_kvcomp.server.results import ResultTap
from vllm_kvcomp.spec import CompressionSpec

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

HEADER_KEY = protocol.HEADER.lower().encode()
APPLIED_KEY = protocol.APPLIED_HEADER.lower().encode()


class KVCompressionMiddleware:
    """Turns the compression header/body into ``vllm_xargs`` and reports what was applied."""

    def __init__(self, app: ASGIApp, config: OperatorConfig | None = None):
        self.app = app
        self._config = config
        self._tap: ResultTap | None = None
        self._unavailable: str | None = None  # this engine cannot compress (from its config)
        self._count_context: ContextCounter | None = None  # scope=context on chat routes
        self._ready = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == HEADER_KEY]
        route = protocol.ROUTES.get(scope["path"])
        content = _content_kind(scope)
        if route is None and not headers and content == "other":
            await self.app(scope, receive, send)
            return
        raw = await _read_body(receive)
        if raw is None:  # the client went away before sending its body
            return
        self._setup(scope)
        spec: CompressionSpec | None = None
        try:
            if route is None:
                body = await _form(scope, raw) if content == "form" else _json_body(raw)
                protocol.refuse_elsewhere(scope["path"], headers, body)
                if content == "json" and raw.strip() and not isinstance(body, dict):
                    # every vLLM POST route reads an object; some index any other value (HTTP 500)
                    raise protocol.RequestError("body", "must be a JSON object")
            elif raw.strip():  # an empty body is vLLM's to refuse
                body = protocol.parse_json(raw)
                if isinstance(body, dict):  # another JSON value is vLLM's to refuse
                    spec = protocol.resolve(self._config, headers, body, scope["path"], self._count_context)
                    raw = _dump(protocol.rewrite_body(body, spec, route.target))
        except protocol.RequestError as err:
            await _send_json(send, 400, err.to_json())
            return
        if spec is not None:
            send = _ResponseRewriter(send, spec, self._tap, route.results, self._uncompressed_because(spec, body))
        await self.app(_with_length(scope, len(raw)), _replay(raw, receive), send)

    def _uncompressed_because(self, spec: CompressionSpec, body: Any) -> str | None:
        """Why a request asking for compression runs uncompressed whatever the engine does (the
        engine cannot compress; vLLM's beam search issues its own requests without it), or None."""
        if not spec.compresses:
            return None
        if isinstance(body, dict) and body.get("use_beam_search") is True:
            return "beam search runs uncompressed (vLLM's beam search issues its own engine requests)"
        return self._unavailable

    def _setup(self, scope: Scope) -> None:
        """Load the operator config and tap the engine client, once (they live in ``app.state``)."""
        if self._ready:
            return
        state = getattr(scope.get("app"), "state", None)
        args = getattr(state, "args", None)
        if self._config is None:
            self._config = OperatorConfig.for_server(getattr(args, "kv_compression_config", None),
                                                     getattr(args, "model", None))
        source = getattr(args, "tokenizer", None) or getattr(args, "model", None)
        if source:
            self._count_context = ContextCounter(str(source), getattr(args, "chat_template", None))
        client = getattr(state, "engine_client", None)
        if client is not None:
            self._tap = ResultTap.install(client)
            self._unavailable = unavailable_reason(getattr(client, "vllm_config", None))
        self._ready = True


class _ResponseRewriter:
    """``send`` that adds the applied header and the usage extension to successful responses."""

    def __init__(self, send: Send, spec: CompressionSpec, tap: ResultTap | None, results: str | None,
                 uncompressed_because: str | None = None):
        self._send = send
        applied = protocol.NO_COMPRESSION if uncompressed_because else protocol.applied_header(spec)
        self._applied = applied.encode("latin-1")
        self._tap = tap if results is not None else None
        self._results = results
        self._mode = "pass"  # "json": buffered and rewritten, "sse": events rewritten, "pass"
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._pending = b""
        self._held: dict[str, Any] | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            await self._on_start(message)
        elif message["type"] == "http.response.body" and self._mode == "json":
            await self._on_json_body(message)
        elif message["type"] == "http.response.body" and self._mode == "sse":
            await self._on_sse_body(message)
        else:
            await self._send(message)

    async def _on_start(self, message: Message) -> None:
        if message["status"] >= 400:
            await self._send(message)
            return
        headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != APPLIED_KEY]
        headers.append((APPLIED_KEY, self._applied))
        message = {**message, "headers": headers}
        content_type = _header(headers, b"content-type")
        if content_type.startswith(b"application/json"):
            self._mode, self._start = "json", message
            return
        if content_type.startswith(b"text/event-stream"):
            self._mode = "sse"
        await self._send(message)

    # ------------------------------------------------------------------ JSON
    async def _on_json_body(self, message: Message) -> None:
        self._chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(self._chunks)
        data = _json_object(body)
        usage = data.get("usage") if data is not None else None
        extension = self._extension(data) if isinstance(usage, dict) else None
        if extension is not None:
            usage["kv_compression"] = extension
            body = _dump(data)
        start = self._start
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        if extension is not None and extension.get("reason"):  # the engine says it served it uncompressed
            headers = [(k, v) for k, v in headers if k.lower() != APPLIED_KEY]
            headers.append((APPLIED_KEY, protocol.NO_COMPRESSION.encode("latin-1")))
        await self._send({**start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    # ------------------------------------------------------------------ server-sent events
    async def _on_sse_body(self, message: Message) -> None:
        self._pending += message.get("body", b"")
        *events, self._pending = self._pending.split(b"\n\n")
        out = b"".join([await self._on_event(event) for event in events])
        more = message.get("more_body", False)
        if not more:  # stream ended without [DONE]: flush what is left unchanged
            out += self._release() + self._pending
        if out or not more:
            await self._send({"type": "http.response.body", "body": out, "more_body": more})

    async def _on_event(self, event: bytes) -> bytes:
        """Events pass through at once, except a possibly-final chunk, held until the next event."""
        payload = event[len(b"data: "):] if event.startswith(b"data: ") else None
        if payload == b"[DONE]":
            if self._held is not None:
                extension = self._extension(self._held)
                if extension is not None:
                    usage = self._held.get("usage")
                    target = usage if isinstance(usage, dict) else self._held
                    target["kv_compression"] = extension
            return self._release() + event + b"\n\n"
        chunk = _json_object(payload) if payload is not None else None
        released = self._release()
        if chunk is not None and _maybe_final(chunk):
            self._held = chunk
            return released
        return released + event + b"\n\n"

    def _release(self) -> bytes:
        held, self._held = self._held, None
        return b"" if held is None else b"data: " + _dump(held) + b"\n\n"

    # ------------------------------------------------------------------ results
    def _extension(self, data: dict[str, Any] | None) -> dict[str, Any] | None:
        """``usage.kv_compression`` for the response with this ``id``, if the engine reported it."""
        if self._tap is None or data is None or not isinstance(data.get("id"), str):
            return None
        response_id, mode = data["id"], self._results
        if mode == "by_object":  # /invocations answers as chat or as completions
            mode = "prompts" if data.get("object") == "text_completion" else "one"
        if mode == "prompts":
            results = self._tap.pop_numbered(response_id, "-")
        elif mode == "numbered":
            results = self._tap.pop_numbered(response_id, "_")
        else:
            results = [r for r in (self._tap.pop(response_id),) if r is not None]
        return protocol.usage_extension(results) if results else None


# ---------------------------------------------------------------------------- helpers


async def _read_body(receive: Receive) -> bytes | None:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to the real one (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-length", b"transfer-encoding")]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


def _dump(data: Any) -> bytes:
    """Compact UTF-8 JSON; ``\\u`` escapes where the text holds lone surrogates (valid JSON escapes)."""
    try:
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(data, separators=(",", ":")).encode()


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """A JSON object vLLM wrote (a response or stream chunk), or None."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _content_kind(scope: Scope) -> str:
    """``json`` (declared, or not declared at all), ``form`` or ``other``."""
    content_type = _header(scope["headers"], b"content-type").split(b";")[0].strip()
    if content_type in (b"", b"application/json") or content_type.endswith(b"+json"):
        return "json"
    if content_type in (b"multipart/form-data", b"application/x-www-form-urlencoded"):
        return "form"
    return "other"


def _json_body(raw: bytes) -> Any:
    """The body of a request outside the compression routes as JSON: None if it is not JSON
    (vLLM refuses it), RequestError if it is JSON that cannot be parsed safely."""
    start = raw.lstrip()[:1]
    return protocol.parse_json(raw) if start in (b"{", b"[") else None


async def _form(scope: Scope, raw: bytes) -> protocol.JsonObject | None:
    """The fields of a form body (audio routes send ``vllm_xargs`` as a JSON text field)."""
    from starlette.requests import Request

    try:
        form = await Request(scope, _replay(raw, _no_more)).form()
    except Exception:  # a form starlette cannot parse: vLLM refuses it the same way
        return None
    try:
        fields = [(key, _json_body(value.encode("utf-8", "surrogatepass")) if key == protocol.XARGS_FIELD else value)
                  for key, value in form.multi_items() if isinstance(value, str)]
        return protocol.JsonObject(fields)
    finally:
        await form.close()


async def _no_more() -> Message:
    return {"type": "http.disconnect"}


def _header(headers: Any, name: bytes) -> bytes:
    return next((v.lower() for k, v in headers if k.lower() == name), b"")


def _maybe_final(chunk: dict[str, Any]) -> bool:
    """A chunk that may be the last of its stream: it has usage or finishes a choice."""
    choices = chunk.get("choices")
    finishing = isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") is not None for c in choices
    )
    return finishing or isinstance(chunk.get("usage"), dict)


async def _send_json(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
