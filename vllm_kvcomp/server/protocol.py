"""The HTTP contract of compression: where a request's spec comes from, errors, usage numbers.

A request may carry its compression settings in three places, each validated on its own by
:class:`CompressionSpec` (so errors are the same everywhere):

- the ``X-KV-Compression`` header (``policy=lagkv; ratio=0.25``),
- a ``kv_compression`` object in the JSON body (``{"policy": "lagkv", "ratio": 0.25}``),
- flat ``kvcomp_*`` keys in the body's ``vllm_xargs`` (``{"kvcomp_policy": "lagkv", ...}``).

There is no precedence: when several are given they must describe the same spec, otherwise the
request is refused. The one spec (or none) then goes through :meth:`OperatorConfig.resolve`,
and the result is written back as the only ``kvcomp_*`` keys of ``vllm_xargs``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_kvcomp.params import SpecError
from vllm_kvcomp.server.operator_config import OperatorConfig
from vllm_kvcomp.spec import XARGS_PREFIX, CompressionSpec

HEADER = "X-KV-Compression"
APPLIED_HEADER = "X-KV-Compression-Applied"
BODY_FIELD = "kv_compression"
XARGS_FIELD = "vllm_xargs"
NO_COMPRESSION = "none"
# Routes whose requests are compressed; every other route refuses compression settings.
CHAT_ROUTE = "/v1/chat/completions"
COMPLETION_ROUTE = "/v1/completions"
COMPRESSION_ROUTES = (CHAT_ROUTE, COMPLETION_ROUTE)
ERROR_TYPE = "BadRequestError"  # what vLLM itself answers for HTTP 400


class RequestError(ValueError):
    """A client mistake answered with HTTP 400 in OpenAI's error shape; ``param`` names the field."""

    def __init__(self, param: str, message: str, allowed: str | None = None):
        self.param = param
        text = f"{param}: {message}"
        if allowed:
            text += f" (allowed: {allowed})"
        self.message = text
        super().__init__(text)

    @classmethod
    def from_spec_error(cls, err: SpecError, source: str) -> RequestError:
        """Name the field as the client wrote it, with the source in front (``kv_compression.ratio``)."""
        param = err.field if err.field in (source, HEADER) else f"{source}.{err.field}"
        return cls(param, err.message, err.allowed)

    def to_json(self) -> bytes:
        error = {"message": self.message, "type": ERROR_TYPE, "param": self.param, "code": 400}
        return json.dumps({"error": error}).encode()


@dataclass(frozen=True)
class Requested:
    """A validated spec and where it came from (``X-KV-Compression``, ``kv_compression``, ``vllm_xargs``)."""

    source: str
    spec: CompressionSpec


def from_header(values: Sequence[str]) -> Requested | None:
    """The spec of the ``X-KV-Compression`` header values (none, or exactly one)."""
    if not values:
        return None
    if len(values) > 1:
        raise RequestError(HEADER, f"header given {len(values)} times", "one X-KV-Compression header")
    try:
        return Requested(HEADER, CompressionSpec.from_header(values[0]))
    except SpecError as err:
        raise RequestError.from_spec_error(err, HEADER) from None


def from_body(body: Mapping[str, Any]) -> Requested | None:
    """The spec of the body's ``kv_compression`` object (absent or null: none)."""
    value = body.get(BODY_FIELD)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RequestError(BODY_FIELD, f"expected an object, got {_json_type(value)}",
                           '{"policy": NAME, "ratio": 0.25, ...}')
    try:
        return Requested(BODY_FIELD, CompressionSpec.from_mapping(value))
    except SpecError as err:
        raise RequestError.from_spec_error(err, BODY_FIELD) from None


def from_xargs(body: Mapping[str, Any]) -> Requested | None:
    """The spec of the ``kvcomp_*`` keys of ``vllm_xargs`` (none if there are none)."""
    xargs = body.get(XARGS_FIELD)
    if not isinstance(xargs, Mapping):  # absent, or vLLM rejects it itself
        return None
    try:
        spec = CompressionSpec.from_xargs(xargs)
    except SpecError as err:
        raise RequestError.from_spec_error(err, XARGS_FIELD) from None
    return None if spec is None else Requested(XARGS_FIELD, spec)


def requested(headers: Sequence[str], body: Mapping[str, Any]) -> Requested | None:
    """The one spec the request asks for; RequestError if a source is invalid or two disagree."""
    found = [r for r in (from_header(headers), from_body(body), from_xargs(body)) if r is not None]
    for other in found[1:]:
        if other.spec != found[0].spec:
            raise RequestError(
                other.source,
                f"asks for {other.spec.to_header()!r} but {found[0].source} asks for "
                f"{found[0].spec.to_header()!r}",
                "one source, or the same settings in each",
            )
    return found[0] if found else None


def resolve(config: OperatorConfig, headers: Sequence[str], body: Mapping[str, Any]) -> CompressionSpec:
    """The spec to run: the request's, or the operator default, as the operator config permits."""
    asked = requested(headers, body)
    if asked is None:
        return config.resolve(None)
    try:
        return config.resolve(asked.spec)
    except SpecError as err:
        if asked.source == XARGS_FIELD:
            err = SpecError(XARGS_PREFIX + err.field, err.message, err.allowed)
        raise RequestError.from_spec_error(err, asked.source) from None


def rewrite_body(body: dict[str, Any], spec: CompressionSpec) -> dict[str, Any]:
    """``body`` without ``kv_compression`` and client ``kvcomp_*`` keys, plus the resolved ones."""
    out = {k: v for k, v in body.items() if k != BODY_FIELD}
    xargs = out.get(XARGS_FIELD)
    kept = {k: v for k, v in xargs.items() if not k.startswith(XARGS_PREFIX)} if isinstance(xargs, dict) else {}
    merged = {**kept, **(spec.to_xargs() if spec.compresses else {})}
    if merged:
        out[XARGS_FIELD] = merged
    elif isinstance(xargs, dict):
        out.pop(XARGS_FIELD)
    return out


def refuse_elsewhere(headers: Sequence[str], body: Any) -> None:
    """Outside :data:`COMPRESSION_ROUTES`: RequestError if the request carries compression settings."""
    allowed = " and ".join(COMPRESSION_ROUTES)
    if headers:
        raise RequestError(HEADER, "compression is not supported on this route", allowed)
    if not isinstance(body, Mapping):
        return
    if body.get(BODY_FIELD) is not None:
        raise RequestError(BODY_FIELD, "compression is not supported on this route", allowed)
    xargs = body.get(XARGS_FIELD)
    if isinstance(xargs, Mapping) and any(str(k).startswith(XARGS_PREFIX) for k in xargs):
        raise RequestError(XARGS_FIELD, "kvcomp_* keys are not supported on this route", allowed)


def applied_header(spec: CompressionSpec) -> str:
    """Value of ``X-KV-Compression-Applied``: the canonical spec, or ``none``."""
    return spec.to_header() if spec.compresses else NO_COMPRESSION


# ---------------------------------------------------------------------------- usage numbers

USAGE_SUMS = ("prompt_tokens", "tokens_kept", "tokens_evicted", "blocks_freed", "compressions",
              "compression_seconds", "preemptions")


def uncompressed_result(prompt_tokens: int) -> dict[str, Any]:
    """The engine result of a request that ran without compression."""
    return {"applied": NO_COMPRESSION, "policy": "full", "prompt_tokens": prompt_tokens,
            "tokens_kept": prompt_tokens, "kept_max_head": prompt_tokens, "kept_fraction": 1.0,
            "tokens_evicted": 0, "blocks_freed": 0, "compressions": 0, "compression_seconds": 0.0,
            "preemptions": 0}


def usage_extension(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``usage.kv_compression`` for the engine results of one response (several for a prompt list).

    Per request (see ``RequestStats``): ``tokens_kept`` the mean kept tokens per (layer, KV head)
    after the last compression, ``kept_max_head`` the largest head, ``kept_fraction`` kept cells
    over live cells (≤ 1); ``tokens_evicted`` is summed over layers and heads. For several prompts
    the counts are summed, ``kept_max_head`` is the largest and ``kept_fraction`` is weighted by
    prompt tokens.
    """
    first = results[0]
    out: dict[str, Any] = {"applied": first["applied"], "policy": first["policy"]}
    for key in USAGE_SUMS:
        out[key] = sum(r.get(key, 0) for r in results)
    out["compression_seconds"] = round(out["compression_seconds"], 6)
    out["kept_max_head"] = max(r.get("kept_max_head", r["prompt_tokens"]) for r in results)
    prompt = out["prompt_tokens"]
    weighted = sum(r.get("kept_fraction", 1.0) * r["prompt_tokens"] for r in results)
    out["kept_fraction"] = round(weighted / prompt, 6) if prompt else 1.0
    return out


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", str: "a string", int: "a number", float: "a number", list: "an array"}
    return names.get(type(value), type(value).__name__)
