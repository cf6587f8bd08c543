"""The HTTP contract of compression: routes, where a request's spec comes from, errors, usage numbers.

A request may carry its compression settings in four places, all read (case-insensitively) and
validated by :class:`CompressionSpec` on every POST route, so errors are the same everywhere:

- the ``X-KV-Compression`` header (``policy=lagkv; ratio=0.25``),
- a ``kv_compression`` object in the JSON body (``{"policy": "lagkv", "ratio": 0.25}``),
- flat ``kvcomp_*`` keys in the body's ``vllm_xargs`` (``{"kvcomp_policy": "lagkv", ...}``),
- flat ``kvcomp_*`` keys in ``sampling_params.extra_args`` (``/inference/v1/generate``).

There is no precedence: the same key twice in one place (a case variant or a repeated JSON key)
must carry the same value, and several places must describe the same spec, otherwise the request
is refused naming both. On a route of :data:`ROUTES` the one spec (or none) then goes through
:meth:`OperatorConfig.resolve` (default, allow-list, bounds) and replaces every client setting as
the only ``kvcomp_*`` keys of the place that route reads; every other POST route refuses
compression settings.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kvcomp.params import SpecError, show
from vllm_kvcomp.policies.head_split import HeadSplit
from vllm_kvcomp.policies.registry import get_policy_class
from vllm_kvcomp.server.operator_config import OperatorConfig
from vllm_kvcomp.spec import XARGS_PREFIX, CompressionSpec, same_value, setting_items

HEADER = "X-KV-Compression"
APPLIED_HEADER = "X-KV-Compression-Applied"
BODY_FIELD = "kv_compression"
XARGS_FIELD = "vllm_xargs"
SAMPLING_FIELD = "sampling_params"
EXTRA_ARGS_FIELD = "extra_args"
NESTED_FIELD = f"{SAMPLING_FIELD}.{EXTRA_ARGS_FIELD}"
NO_COMPRESSION = "none"
ERROR_TYPE = "BadRequestError"  # what vLLM itself answers for HTTP 400
#: Deepest JSON nesting a body may have (vLLM's parser fails near Python's recursion limit).
MAX_JSON_DEPTH = 256


@dataclass(frozen=True)
class Route:
    """A POST route whose requests reach the engine's ``generate`` with ``SamplingParams``.

    ``target``: where vLLM reads the flat ``kvcomp_*`` keys of this route's body
    (:data:`XARGS_FIELD` or :data:`NESTED_FIELD`). ``results``: the engine request ids of a
    response, for ``usage.kv_compression``: ``one`` (the response id), ``prompts`` (``<id>-0``,
    ``<id>-1``, ...), ``numbered`` (``<id>_0``, ...), ``by_object`` (as chat or completions, by
    the response's ``object``); None: the route gets the applied header only.
    """

    path: str
    target: str = XARGS_FIELD
    results: str | None = None


CHAT_ROUTE = "/v1/chat/completions"
COMPLETION_ROUTE = "/v1/completions"
#: Every route that compresses (documented in docs/operator_config.md); all other POSTs refuse.
ROUTES: dict[str, Route] = {r.path: r for r in (
    Route(CHAT_ROUTE, results="one"),
    Route(COMPLETION_ROUTE, results="prompts"),
    Route("/v1/chat/completions/batch", results="numbered"),
    Route("/v1/responses", results="numbered"),
    Route("/v1/messages"),
    Route("/invocations", results="by_object"),
    Route("/inference/v1/generate", target=NESTED_FIELD),
    Route("/v1/chat/completions/render"),
    Route("/v1/completions/render"),
    Route("/v1/responses/render"),
    Route("/v1/messages/render"),
)}
COMPRESSION_ROUTES = tuple(ROUTES)


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


# ---------------------------------------------------------------------------- JSON bodies


class JsonObject(dict):
    """A parsed JSON object that remembers the values its repeated keys shadowed."""

    __slots__ = ("shadowed",)

    def __init__(self, pairs: Iterable[tuple[str, Any]] = ()):
        super().__init__()
        self.shadowed: list[tuple[str, Any]] = []
        for key, value in pairs:
            if key in self:
                self.shadowed.append((key, self[key]))
            self[key] = value


def pairs(obj: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Every (key, value) of ``obj``, repeated JSON keys included."""
    return [*getattr(obj, "shadowed", ()), *obj.items()]


def parse_json(raw: bytes) -> Any:
    """The body as JSON (objects as :class:`JsonObject`); RequestError if it cannot be."""
    too_deep = RequestError("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
                            f"at most {MAX_JSON_DEPTH} levels of nesting")
    try:
        data = json.loads(raw, object_pairs_hook=JsonObject)
    except RecursionError:
        raise too_deep from None
    except ValueError as err:  # also UnicodeDecodeError and integers too long to convert
        raise RequestError("body", f"not valid JSON ({str(err)[:120]})", "a JSON object") from None
    if _deeper_than(data, MAX_JSON_DEPTH):
        raise too_deep
    return data


def _deeper_than(data: Any, limit: int) -> bool:
    """Whether ``data`` nests objects/arrays more than ``limit`` levels (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)
                     if isinstance(child, (dict, list)))
    return False


# ---------------------------------------------------------------------------- where settings are


@dataclass(frozen=True)
class Requested:
    """A validated spec and where it came from (``X-KV-Compression``, ``kv_compression``, ...)."""

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


def _field(obj: Mapping[str, Any], name: str) -> tuple[str, Any] | None:
    """(key as written, value) of field ``name`` of ``obj`` (case-insensitive; null = absent);
    RequestError if it is given twice with different values."""
    hits = [(str(k), v) for k, v in pairs(obj) if str(k).strip().lower() == name and v is not None]
    for key, value in hits[1:]:
        if not same_value(hits[0][1], value):
            raise RequestError(key, f"given twice with different values: {hits[0][0]}={show(hits[0][1])} "
                                    f"and {key}={show(value)}", "each key once (keys are case-insensitive)")
    return hits[0] if hits else None


def from_body(body: Mapping[str, Any]) -> Requested | None:
    """The spec of the body's ``kv_compression`` object (absent or null: none)."""
    hit = _field(body, BODY_FIELD)
    if hit is None:
        return None
    written, value = hit
    if not isinstance(value, Mapping):
        raise RequestError(written, f"expected an object, got {_json_type(value)}",
                           '{"policy": NAME, "ratio": 0.25, ...}')
    try:
        items = setting_items(pairs(value))
        return Requested(written, CompressionSpec.from_mapping({k: v for k, (_, v) in items.items()}))
    except SpecError as err:
        raise RequestError.from_spec_error(err, written) from None


def from_flat(container: Any, source: str) -> Requested | None:
    """The spec of the ``kvcomp_*`` keys of ``container`` (``vllm_xargs`` / ``extra_args``), if any."""
    if not isinstance(container, Mapping):  # absent, or vLLM refuses it itself
        return None
    try:
        found = setting_items(pairs(container), XARGS_PREFIX)
    except SpecError as err:
        raise RequestError.from_spec_error(err, source) from None
    if not found:
        return None
    try:
        return Requested(source, CompressionSpec.from_mapping({k: v for k, (_, v) in found.items()}))
    except SpecError as err:
        field = found[err.field][0] if err.field in found else XARGS_PREFIX + err.field
        raise RequestError.from_spec_error(SpecError(field, err.message, err.allowed), source) from None


def containers(body: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(source name, mapping) of every ``vllm_xargs`` and ``sampling_params.extra_args`` of ``body``."""
    out = [(XARGS_FIELD, v) for k, v in pairs(body) if k == XARGS_FIELD]
    for key, sampling in pairs(body):
        if key == SAMPLING_FIELD and isinstance(sampling, Mapping):
            out += [(NESTED_FIELD, v) for k, v in pairs(sampling) if k == EXTRA_ARGS_FIELD]
    return out


def requested(headers: Sequence[str], body: Mapping[str, Any]) -> Requested | None:
    """The one spec the request asks for; RequestError if a place is invalid or two disagree."""
    found = [from_header(headers), from_body(body), *(from_flat(c, name) for name, c in containers(body))]
    found = [r for r in found if r is not None]
    for other in found[1:]:
        if other.spec != found[0].spec:
            raise RequestError(
                other.source,
                f"asks for {other.spec.to_header()!r} but {found[0].source} asks for "
                f"{found[0].spec.to_header()!r}",
                "one source, or the same settings in each",
            )
    return found[0] if found else None


#: routes whose ``messages`` say where a ``scope=context`` request's context ends (the last user
#: message and the generation prompt are the question)
CONTEXT_ROUTES = (CHAT_ROUTE, "/v1/chat/completions/render")
#: counts the prompt tokens before a chat body's last user message (:mod:`.context`)
ContextCounter = Callable[[Mapping[str, Any]], int]


def resolve(config: OperatorConfig, headers: Sequence[str], body: Mapping[str, Any], path: str = CHAT_ROUTE,
            count_context: ContextCounter | None = None) -> CompressionSpec:
    """The spec to run: the request's, or the operator default, as the operator config permits;
    ``scope=context`` without ``context_tokens`` gets them from ``count_context`` on a chat route."""
    asked = requested(headers, body)
    source = HEADER if asked is None else asked.source
    try:
        if asked is None:
            spec = config.resolve(None)
        else:
            spec = config.resolve(asked.spec)
            check_fit(config, spec)
        return fill_context(spec, path, body, count_context)
    except SpecError as err:
        if source in (XARGS_FIELD, NESTED_FIELD):
            err = SpecError(XARGS_PREFIX + err.field, err.message, err.allowed)
        raise RequestError.from_spec_error(err, source) from None


def fill_context(spec: CompressionSpec, path: str, body: Mapping[str, Any],
                 count_context: ContextCounter | None) -> CompressionSpec:
    """``spec`` with ``context_tokens`` set where ``scope=context`` leaves it to the server: the
    tokens before the last user message of a chat route's ``messages``; SpecError elsewhere."""
    if spec.extras.get("scope") != "context" or spec.extras.get("context_tokens") is not None:
        return spec
    allowed = "an integer in [1, 16777216]: the prompt's leading tokens that are the context (POST /tokenize counts them)"
    if path not in CONTEXT_ROUTES or not isinstance(body.get("messages"), list) or count_context is None:
        raise SpecError("context_tokens", f"scope=context on {path} needs it: only a chat's messages tell the server "
                        "where the context ends", allowed)
    tokens = count_context(body)
    if tokens < 1:
        raise SpecError("scope", "context: this chat has no context before its last user message (the question); "
                        "send the context in earlier messages", "all, or context with the context in earlier messages")
    return CompressionSpec.from_mapping({**spec.to_dict(), "context_tokens": tokens})


def check_fit(config: OperatorConfig, spec: CompressionSpec) -> None:
    """SpecError unless the served profile leaves room for the spec's ``ratio`` where the policy's
    retrieval heads keep every token (``razor``, ``duoattention``: :meth:`HeadSplit.check_fit`).
    The prompt's length is not known here: what only a short prompt makes infeasible is served at
    the floor by the engine."""
    cls = get_policy_class(spec.policy)
    ref = config.profiles.get(cls.PROFILE) if issubclass(cls, HeadSplit) else None
    if config.model is None or ref is None:
        return
    profile = _served_profile(cls.PROFILE, config.model, ref)
    if profile is not None:
        from vllm_kvcomp.calibration.profiles import bind_profile

        policy = bind_profile(spec.build_policy(), profile)
        layers = _compressed_layers(config.model) or range(profile.model.num_layers)
        retrieval = sum(1 for layer, _ in policy.retrieval_set() if layer in layers)
        policy.check_fit(retrieval, len(layers) * profile.model.num_kv_heads)


@functools.lru_cache(maxsize=8)
def _compressed_layers(model: str) -> frozenset[int] | None:
    """The layers the engine compresses when ``model``'s config names each layer's attention
    (``layer_types``, e.g. Gemma 3: the full-attention ones; the sliding-window layers stay
    vLLM's); None: every layer (or the config cannot be read: the engine says so)."""
    from vllm_kvcomp.calibration.profiles import compressed_layers

    try:
        layers = compressed_layers(json.loads((Path(model) / "config.json").read_text()).get("layer_types"))
    except (OSError, ValueError):
        return None
    return None if layers is None else frozenset(layers)


@functools.lru_cache(maxsize=8)
def _served_profile(kind: str, model: str, ref: str) -> Any:
    """The ``kind`` profile ``ref`` (a name or a JSON path) of ``model``, or None if it cannot be
    read (the engine says so)."""
    from vllm_kvcomp.calibration.profiles import load_profile

    try:
        if ref.endswith(".json") or "/" in ref:
            return load_profile(kind, path=ref)
        return load_profile(kind, model_dir=model, name=ref)
    except ValueError:
        return None


def rewrite_body(body: dict[str, Any], spec: CompressionSpec, target: str = XARGS_FIELD) -> dict[str, Any]:
    """``body`` without any client compression setting, plus the resolved keys in ``target``."""
    out = {k: v for k, v in body.items() if k.strip().lower() != BODY_FIELD}
    sampling = out.get(SAMPLING_FIELD)
    if isinstance(sampling, dict):
        sampling = out[SAMPLING_FIELD] = dict(sampling)
        _set_flat(sampling, EXTRA_ARGS_FIELD, spec if target == NESTED_FIELD else None)
    _set_flat(out, XARGS_FIELD, spec if target == XARGS_FIELD else None)
    return out


def _set_flat(parent: dict[str, Any], field: str, spec: CompressionSpec | None) -> None:
    """Drop the client's ``kvcomp_*`` keys of ``parent[field]``; add ``spec``'s (if it compresses)."""
    current = parent.get(field)
    kept = {k: v for k, v in current.items() if not str(k).strip().lower().startswith(XARGS_PREFIX)} \
        if isinstance(current, dict) else {}
    merged = {**kept, **(spec.to_xargs() if spec is not None and spec.compresses else {})}
    if merged:
        parent[field] = merged
    elif isinstance(current, dict):
        parent.pop(field)


def refuse_elsewhere(path: str, headers: Sequence[str], body: Any) -> None:
    """Outside :data:`ROUTES`: RequestError if the request carries compression settings."""
    allowed = ", ".join(ROUTES)
    message = f"compression is not supported on {path}"
    if headers:
        raise RequestError(HEADER, message, allowed)
    if not isinstance(body, Mapping):
        return
    hit = _field(body, BODY_FIELD)
    if hit is not None:
        raise RequestError(hit[0], message, allowed)
    for source, container in containers(body):
        if isinstance(container, Mapping) and any(
            str(k).strip().lower().startswith(XARGS_PREFIX) for k, _ in pairs(container)
        ):
            raise RequestError(source, f"kvcomp_* keys are not supported on {path}", allowed)


def applied_header(spec: CompressionSpec) -> str:
    """Value of ``X-KV-Compression-Applied``: the canonical spec, or ``none``."""
    return spec.to_header() if spec.compresses else NO_COMPRESSION


# ---------------------------------------------------------------------------- usage numbers

USAGE_SUMS = ("prompt_tokens", "tokens_kept", "tokens_evicted", "blocks_freed", "compressions",
              "compression_seconds")
#: Summed only over the results that have them: the engine does not track uncompressed requests.
TRACKED_SUMS = ("preemptions", "compression_failures")


def uncompressed_result(prompt_tokens: int) -> dict[str, Any]:
    """The result of a request that ran without compression. The engine did not follow it, so
    there is no ``preemptions`` or ``compression_failures`` count (it would not be known, not zero)."""
    return {"applied": NO_COMPRESSION, "policy": "full", "prompt_tokens": prompt_tokens,
            "tokens_kept": prompt_tokens, "kept_max_head": prompt_tokens, "kept_fraction": 1.0,
            "tokens_evicted": 0, "blocks_freed": 0, "compressions": 0, "compression_seconds": 0.0}


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
    for key in ("requested", "reason"):  # a request the engine served uncompressed: what and why
        if key in first:
            out[key] = first[key]
    for key in USAGE_SUMS:
        out[key] = sum(r.get(key, 0) for r in results)
    for key in TRACKED_SUMS:
        if any(key in r for r in results):
            out[key] = sum(r[key] for r in results if key in r)
    out["compression_seconds"] = round(out["compression_seconds"], 6)
    out["kept_max_head"] = max(r.get("kept_max_head", r["prompt_tokens"]) for r in results)
    prompt = out["prompt_tokens"]
    weighted = sum(min(r.get("kept_fraction", 1.0), 1.0) * r["prompt_tokens"] for r in results)
    out["kept_fraction"] = min(round(weighted / prompt, 6), 1.0) if prompt else 1.0
    return out


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", str: "a string", int: "a number", float: "a number", list: "an array"}
    return names.get(type(value), type(value).__name__)
