"""CompressionSpec: the one typed, validated description of how a request's KV cache is compressed.

Every route (HTTP header, request body, raw ``vllm_xargs``, Python) ends here, so validation and
error messages are identical everywhere. ``ratio`` is the *fraction of tokens kept*
(0.25 = 4x compression); ``budget`` is an absolute kept-token count. Give one or neither.

Header grammar (``X-KV-Compression``): ``key=value`` pairs separated by ``;`` (spaces ignored),
e.g. ``policy=lagkv; ratio=0.25; lag=128``. A bare word is the policy (``snapkv; ratio=0.5``);
``none`` and ``full`` both mean "do not compress".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from vllm_kvcomp.params import COMMON_PARAMS, NUMBER_TEXT, Scalar, SpecError, show
from vllm_kvcomp.policies.registry import (
    POLICY_NAMES as POLICY_NAMES,  # re-exported: bench/kept.py reads it
)
from vllm_kvcomp.policies.registry import get_policy_class, policy_names

XARGS_PREFIX = "kvcomp_"
MAX_HEADER_LENGTH = 1024
HEADER_SPACES = " \t"  # HTTP's optional whitespace; anything else is part of a key or value
SPEC_FIELDS = ("policy", *COMMON_PARAMS)


@dataclass(frozen=True)
class CompressionSpec:
    """A validated request spec. Unset fields mean "the policy's default".

    Build it with :meth:`from_mapping` (dict / header / xargs) so values are checked; the
    constructor alone does not validate.
    """

    policy: str = "full"
    ratio: float | None = None
    budget: int | None = None
    sink: int | None = None
    window: int | None = None
    lag: int | None = None
    interval: int | None = None
    extras: Mapping[str, Scalar] = field(default_factory=dict)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, field_prefix: str = "") -> CompressionSpec:
        """Validate a flat mapping ``{"policy": ..., "ratio": ..., extra: ...}``.

        ``field_prefix`` is prepended to field names in errors (e.g. ``"kv_compression."``).
        """
        try:
            return cls._from_mapping(data)
        except SpecError as err:
            if field_prefix:
                raise SpecError(field_prefix + err.field, err.message, err.allowed) from None
            raise

    @classmethod
    def _from_mapping(cls, data: Mapping[str, Any]) -> CompressionSpec:
        if not isinstance(data, Mapping):
            raise SpecError("kv_compression", f"expected an object, got {type(data).__name__}")
        items = {key: value for key, (_, value) in setting_items(data.items()).items()}
        names = (*policy_names(), "none")
        if "policy" not in items and items:
            raise SpecError("policy", f"missing: settings {sorted(items)} need a policy", ", ".join(names))
        policy = items.pop("policy", "full")
        if not isinstance(policy, str) or policy.strip().lower() not in names:
            raise SpecError("policy", f"unknown policy {policy!r}", ", ".join(names))
        policy = policy.strip().lower()
        if policy == "none":
            policy = "full"
        policy_cls = get_policy_class(policy)
        accepted = policy_cls.accepted_params()
        values: dict[str, Any] = {}
        extras: dict[str, Scalar] = {}
        for key, raw in items.items():
            if key not in accepted:
                raise SpecError(key, f"unknown key for policy {policy!r}", ", ".join(["policy", *accepted]))
            value = accepted[key].coerce(raw)
            if key in COMMON_PARAMS:
                values[key] = value
            else:
                extras[key] = value
        if values.get("ratio") is not None and values["ratio"] <= 0.0:
            raise SpecError("ratio", "must be greater than 0", "a number in (0, 1]")
        if values.get("ratio") is not None and values.get("budget") is not None:
            raise SpecError("budget", "give either ratio or budget, not both", "ratio or budget")
        spec = cls(policy=policy, extras=extras, **values)
        policy_cls.from_settings(spec.settings())  # cross-field checks live with the policy
        return spec

    @classmethod
    def from_header(cls, header: str) -> CompressionSpec:
        """Parse an ``X-KV-Compression`` header value (see the module docstring for the grammar)."""
        return cls.from_mapping(parse_header(header))

    @classmethod
    def from_xargs(cls, extra_args: Mapping[str, Any] | None) -> CompressionSpec | None:
        """Read flat ``kvcomp_*`` keys from ``SamplingParams.extra_args``; None if there are none."""
        if not extra_args:
            return None
        found = setting_items(extra_args.items(), XARGS_PREFIX)
        if not found:
            return None
        try:
            return cls.from_mapping({key: value for key, (_, value) in found.items()})
        except SpecError as err:
            written = found[err.field][0] if err.field in found else XARGS_PREFIX + err.field
            raise SpecError(written, err.message, err.allowed) from None

    # ----------------------------------------------------------------- views
    @property
    def compresses(self) -> bool:
        return self.policy != "full"

    def to_dict(self) -> dict[str, Scalar]:
        """The fields that are set, flat (extras inline)."""
        out: dict[str, Scalar] = {"policy": self.policy}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("policy", "extras") and value is not None:
                out[f.name] = value
        out.update(self.extras)
        return out

    def to_xargs(self) -> dict[str, Scalar]:
        """Flat ``kvcomp_*`` keys for ``vllm_xargs`` / ``SamplingParams.extra_args``."""
        return {XARGS_PREFIX + k: v for k, v in self.to_dict().items()}

    def to_header(self) -> str:
        """Canonical header form, e.g. ``policy=lagkv; ratio=0.25``."""
        return "; ".join(f"{k}={_fmt(v)}" for k, v in self.to_dict().items())

    def with_defaults(self, defaults: Mapping[str, Any]) -> CompressionSpec:
        """Fill unset fields from ``defaults`` (operator per-policy defaults), then re-validate.

        A request that sets ``ratio`` or ``budget`` overrides both of the defaults' size fields.
        """
        mine = self.to_dict()
        merged = {k: v for k, v in defaults.items() if k != "policy"}
        if "ratio" in mine or "budget" in mine:
            merged.pop("ratio", None)
            merged.pop("budget", None)
        merged.update(mine)
        return CompressionSpec.from_mapping(merged)

    def replace(self, **changes: Any) -> CompressionSpec:
        return replace(self, **changes)

    def settings(self) -> dict[str, Scalar]:
        """The set fields except ``policy``: the keyword arguments of the policy dataclass."""
        return {k: v for k, v in self.to_dict().items() if k != "policy"}

    def build_policy(self):
        """The policy dataclass this spec describes (defaults filled in)."""
        return get_policy_class(self.policy).from_settings(self.settings())


def setting_items(items: Iterable[tuple[Any, Any]], prefix: str = "") -> dict[str, tuple[str, Any]]:
    """``{key: (key as written, value)}`` of the ``items`` whose key starts with ``prefix``.

    Keys are case-insensitive and stripped; ``key`` is lower-case without the prefix. The same
    key twice (a case variant, or a JSON object's duplicate key passed in ``items``) is fine with
    the same value and a SpecError naming both with different values.
    """
    out: dict[str, tuple[str, Any]] = {}
    for raw_key, value in items:
        written = str(raw_key)
        key = written.strip().lower()
        if not key.startswith(prefix):
            continue
        key = key[len(prefix):]
        if key in out and not same_value(out[key][1], value):
            first, before = out[key]
            raise SpecError(
                written,
                f"given twice with different values: {first}={show(before)} and {written}={show(value)}",
                "each key once (keys are case-insensitive)",
            )
        out.setdefault(key, (written, value))
    return out


def same_value(a: Any, b: Any) -> bool:
    """Whether two JSON values given for one key say the same: text case and spaces aside, and a
    number the same as its text (``0.3`` and ``"0.30"``)."""
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return x == y
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().lower() == b.strip().lower()
    return type(a) is type(b) and a == b


def _as_number(value: Any) -> float | None:
    """``value`` as a float if it is a number or an ASCII number's text, else None."""
    if isinstance(value, str) and NUMBER_TEXT.fullmatch(value.strip(" \t")):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def parse_header(header: str) -> dict[str, str]:
    """Split a header value into a raw ``{key: value}`` dict; raises SpecError when malformed."""
    if not isinstance(header, str):
        raise SpecError("X-KV-Compression", "header must be text")
    if len(header) > MAX_HEADER_LENGTH:
        raise SpecError("X-KV-Compression", f"header is {len(header)} characters long",
                        f"at most {MAX_HEADER_LENGTH} characters")
    out: dict[str, str] = {}
    parts = [p.strip(HEADER_SPACES) for p in header.split(";")]
    if not any(parts):
        raise SpecError("X-KV-Compression", "header is empty", "policy=NAME; key=value; ...")
    for i, part in enumerate(parts):
        if not part:
            continue
        if "=" not in part:
            if i == 0:
                out["policy"] = part
                continue
            raise SpecError("X-KV-Compression", f"malformed entry {part!r}", "key=value pairs separated by ';'")
        key, _, value = part.partition("=")
        key, value = key.strip(HEADER_SPACES).lower(), value.strip(HEADER_SPACES)
        if not key or not value:
            raise SpecError("X-KV-Compression", f"malformed entry {part!r}", "key=value pairs separated by ';'")
        if key in out:
            raise SpecError(key, "given twice in the header", "each key once")
        out[key] = value
    return out


def _fmt(value: Scalar) -> str:
    """Header text of a value; floats use the shortest exact round-trip form."""
    return repr(value) if isinstance(value, float) else str(value)
