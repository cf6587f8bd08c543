"""Operator config: the server-wide compression rules passed with ``--kv-compression-config``.

A YAML file (every key optional)::

    default: {policy: full}            # spec for requests that say nothing (or "lagkv; ratio=0.25")
    allow: [full, snapkv, lagkv]       # policies clients may ask for (default: all)
    bounds: {min_ratio: 0.05, max_ratio: 1.0, min_budget: 64, max_budget: 1048576,
             max_window: 512, min_interval: 16}
    policies:                          # per-policy defaults under what a request sets
      lagkv: {ratio: 0.25, lag: 128, sink: 16}
    profiles:                          # calibration profiles: a name in <model>/kvcomp_profiles/
      razor: default                   # or a path (relative paths: from this file's folder)

Everything is checked when the file loads (errors name the YAML path, e.g.
``policies.lagkv.ratio``): the per-policy defaults through :class:`CompressionSpec`, and the
built-in defaults of every allowed policy against ``bounds``, so a request can only fail on
what the client itself sent. :meth:`OperatorConfig.resolve` then turns a client's spec into
the spec to run, raising :class:`SpecError` (HTTP 400) with the field as the client named it.

``python -m vllm_kvcomp.server.operator_config check FILE...`` validates files;
``... schema`` prints the JSON schema the Helm chart's values embed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vllm_kvcomp.calibration.profiles import KINDS as PROFILE_KINDS
from vllm_kvcomp.calibration.profiles import ProfileError, calibrate_command, check_name
from vllm_kvcomp.params import Param, Scalar, SpecError
from vllm_kvcomp.policies.registry import NO_COMPRESSION_WORDS, POLICY_NAMES
from vllm_kvcomp.spec import CompressionSpec, parse_header

PolicyName = Literal[POLICY_NAMES]  # type: ignore[valid-type]
ProfileKind = Literal[PROFILE_KINDS]  # type: ignore[valid-type]
# Effective policy fields that ``bounds`` limits (``lag``: LagKV recompresses every ``lag`` steps;
# ``observe``: the observation window of pod, expected_attention and criticalkv, by ``max_window``).
BOUNDED_FIELDS = ("ratio", "budget", "window", "observe", "interval", "lag")
#: Default ``bounds.min_interval``: decode steps between two compressions of one request. One
#: compression of a 2K-token request on the bundled model costs about as much as a few decode
#: steps (docs/operator_config.md has the measurements), so one compression per 16 steps keeps
#: the neighbours' slowdown near 10%; it is also the built-in default of every policy's interval.
DEFAULT_MIN_INTERVAL = 16


class ConfigError(ValueError):
    """An invalid operator config. ``path`` is the YAML path of the bad key (``""`` = the file)."""

    def __init__(self, path: str, message: str, allowed: str | None = None, source: str | None = None):
        self.path = path
        self.message = message
        self.allowed = allowed
        self.source = source
        text = f"{path}: {message}" if path else message
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(f"{source}: {text}" if source else text)


def requires_profile(policy: str) -> str | None:
    """The calibration profile kind ``policy`` needs (``"razor"``, ``"pod"``) or None."""
    from vllm_kvcomp.policies.registry import get_policy_class

    return get_policy_class(policy).PROFILE


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Bounds(_Model):
    """Limits on what a client may request; checked on the effective (defaults-filled) values."""

    min_ratio: float = Field(0.05, gt=0, le=1, description="smallest kept fraction a request may set")
    max_ratio: float = Field(1.0, gt=0, le=1, description="largest kept fraction a request may set")
    min_budget: int = Field(64, ge=1, description="smallest kept-token budget per head")
    max_budget: int = Field(1 << 20, ge=1, description="largest kept-token budget per head")
    max_window: int = Field(512, ge=0, description="largest observation/recent window")
    min_interval: int = Field(
        DEFAULT_MIN_INTERVAL, ge=1,
        description="fewest decode steps between recompressions (interval, filled in where a request "
        "recompresses without one; lagkv: lag)",
    )

    def admit(self, spec: CompressionSpec) -> CompressionSpec:
        """``spec`` within the bounds (SpecError naming the field otherwise), with ``interval`` =
        ``min_interval`` where it recompresses during decode and leaves ``interval`` unset
        (``decode=recompress`` on a method without one of its own, which would otherwise
        recompress whenever a page is over its budget)."""
        policy = spec.build_policy()
        if policy.recompresses and policy.interval is None and policy.PACED_BY_INTERVAL:
            spec = spec.with_defaults({"interval": self.min_interval})
            policy = spec.build_policy()
        self.check(policy)
        return spec

    def check(self, policy: Any) -> None:
        """SpecError naming the first field of ``policy`` (a built policy) outside the bounds."""
        limits = {
            "ratio": (self.min_ratio, self.max_ratio, "a number in [{lo:g}, {hi:g}]"),
            "budget": (self.min_budget, self.max_budget, "an integer in [{lo}, {hi}]"),
            "window": (0, self.max_window, "an integer in [{lo}, {hi}]"),
            "observe": (0, self.max_window, "an integer in [{lo}, {hi}] (bounds.max_window)"),
            "interval": (self.min_interval, None, "an integer >= {lo}"),
            "lag": (self.min_interval, None, "an integer >= {lo}: lagkv recompresses every `lag` decode steps"),
        }
        for name in BOUNDED_FIELDS:
            value = getattr(policy, name, None)
            lo, hi, allowed = limits[name]
            if value is not None and (value < lo or (hi is not None and value > hi)):
                raise SpecError(
                    name, f"{value:g} is outside this server's bounds", allowed.format(lo=lo, hi=hi)
                )


class _File(_Model):
    """The YAML document as written (structure only; specs are checked afterwards)."""

    default: Any = Field("full", description="spec for requests that say nothing")
    allow: list[PolicyName] = Field(list(POLICY_NAMES), min_length=1, description="policies clients may use")
    bounds: Bounds = Field(Bounds(), description="limits on client input")
    policies: dict[PolicyName, dict[str, Any]] = Field({}, description="per-policy defaults")
    profiles: dict[ProfileKind, str] = Field({}, description="calibration profile per kind")


@dataclass(frozen=True)
class OperatorConfig:
    """A validated operator config. Build it with :meth:`load` or :meth:`validate_mapping`."""

    default_spec: CompressionSpec = field(default_factory=CompressionSpec)
    allow: tuple[str, ...] = POLICY_NAMES
    bounds: Bounds = field(default_factory=Bounds)
    policies: Mapping[str, Mapping[str, Scalar]] = field(default_factory=dict)
    profiles: Mapping[str, str] = field(default_factory=dict)
    source: str | None = None
    model: str | None = None  # the served model folder, for "create the profile with ..." hints

    # ----------------------------------------------------------------- construction
    @classmethod
    def default(cls) -> OperatorConfig:
        """No compression unless asked, every policy allowed, default bounds, no profiles."""
        return cls.validate_mapping({})

    @classmethod
    def for_server(cls, path: str | Path | None, model: str | None) -> OperatorConfig:
        """The config a server of ``model`` runs: the file at ``path`` (or the defaults), with the
        calibration profiles found for the model (its ``kvcomp_profiles/`` or the package store)
        for every kind the file does not set."""
        from vllm_kvcomp.calibration.profiles import available_profiles

        found = available_profiles(model) if model and Path(model).is_dir() else {}
        config = cls.load(path, found) if path else cls.validate_mapping({}, found_profiles=found)
        return replace(config, model=model)

    @classmethod
    def load(cls, path: str | Path, found_profiles: Mapping[str, str] | None = None) -> OperatorConfig:
        """Read and validate a YAML file; ConfigError names the file and the bad key."""
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError("", f"cannot read the file: {err.strerror or err}", source=source) from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError("", f"not valid YAML: {err}", source=source) from None
        return cls.validate_mapping({} if data is None else data, source=source, found_profiles=found_profiles)

    @classmethod
    def validate_mapping(cls, data: Any, *, source: str | None = None,
                         found_profiles: Mapping[str, str] | None = None) -> OperatorConfig:
        """Validate a parsed document (the path :meth:`load` and the Helm chart tests use);
        ``found_profiles`` (kind -> name) apply where ``profiles`` does not say otherwise."""
        try:
            return cls._validate(data, source, dict(found_profiles or {}))
        except ConfigError as err:
            raise ConfigError(err.path, err.message, err.allowed, source) from None

    @classmethod
    def _validate(cls, data: Any, source: str | None, found_profiles: dict[str, str]) -> OperatorConfig:
        if not isinstance(data, Mapping):
            raise ConfigError("", f"expected a mapping, got {type(data).__name__}", ", ".join(_File.model_fields))
        try:
            raw = _File.model_validate(dict(data))
        except ValidationError as err:
            raise _config_error(err) from None
        _check_bounds_order(raw.bounds)
        policies = {name: _policy_defaults(name, values) for name, values in raw.policies.items()}
        profiles = {**found_profiles, **{kind: _profile_ref(kind, ref, source) for kind, ref in raw.profiles.items()}}
        config = cls(
            default_spec=CompressionSpec(),
            allow=tuple(dict.fromkeys(raw.allow)),
            bounds=raw.bounds,
            policies=policies,
            profiles=profiles,
            source=source,
        )
        for name in config.allow:
            config.check_builtin_defaults(name)
        return replace(config, default_spec=_default_spec(raw.default, config))

    @staticmethod
    def json_schema() -> dict[str, Any]:
        """JSON schema of the file (draft-07 compatible, no ``$ref``): the chart embeds it."""
        schema = _inline_refs(_File.model_json_schema())
        props = schema["properties"]
        props["default"] = {
            "description": props["default"]["description"],
            "default": "full",
            "anyOf": [
                {"type": "string", "description": "a policy name or a header-style spec"},
                {
                    "type": "object",
                    "properties": {"policy": {"enum": [*POLICY_NAMES, "none"]}},
                    "additionalProperties": {"type": ["integer", "number", "string", "boolean"]},
                },
            ],
        }
        props["policies"] = {
            "description": props["policies"]["description"],
            "type": "object",
            "default": {},
            "properties": {name: _policy_schema(name) for name in POLICY_NAMES},
            "additionalProperties": False,
        }
        schema.pop("title", None)
        return schema

    # ----------------------------------------------------------------- requests
    def resolve(self, requested: CompressionSpec | None, *, explicit_none: bool = False) -> CompressionSpec:
        """The spec to run for a request; SpecError (HTTP 400) if the server does not permit it.

        ``requested`` None means the request said nothing: the operator's ``default`` applies,
        unless ``explicit_none`` (the client explicitly asked for no compression), which is
        treated as a request for ``full``. A request gets its policy's operator defaults under
        what it set, then is checked against ``allow``, loaded profiles and ``bounds``.
        """
        if requested is None:
            if not explicit_none:
                return self.default_spec
            requested = CompressionSpec()
        policy = requested.policy
        if policy not in self.allow:
            raise SpecError("policy", f"policy {policy!r} is not enabled on this server", ", ".join(self.usable_policies()))
        kind = requires_profile(policy)
        if kind is not None and kind not in self.profiles:
            create = calibrate_command(self.model or "MODEL", kind)
            raise SpecError(
                "policy",
                f"policy {policy!r} needs a {kind!r} calibration profile and this server has none loaded "
                f"(an operator creates it with `{create}` and restarts the server)",
                ", ".join(self.usable_policies()),
            )
        asked = requested.extras.get("profile")
        if kind is not None and asked not in (None, "default"):
            raise SpecError("profile", f"this server serves one {kind!r} calibration profile", "default")
        return self.bounds.admit(requested.with_defaults(self.policies.get(policy, {})))

    def usable_policies(self) -> tuple[str, ...]:
        """Allowed policies whose calibration profile (if any) is configured."""
        return tuple(p for p in self.allow if requires_profile(p) in (None, *self.profiles))

    # ----------------------------------------------------------------- load-time checks
    def check_builtin_defaults(self, name: str) -> None:
        """The operator defaults + class defaults of an allowed policy must fit the bounds."""
        try:
            spec = CompressionSpec(policy=name).with_defaults(self.policies.get(name, {}))
            self.bounds.admit(spec)
        except SpecError as err:
            raise ConfigError(
                f"policies.{name}.{err.field}",
                f"{err.message} (the policy's default when policies.{name} does not set it); "
                f"set policies.{name}.{err.field} or widen bounds",
                err.allowed,
            ) from None


# ---------------------------------------------------------------------------- helpers


def _default_spec(raw: Any, config: OperatorConfig) -> CompressionSpec:
    """Parse ``default`` (mapping or header-style string) with its policy's operator defaults."""
    try:
        if isinstance(raw, str):
            mapping: Mapping[str, Any] = parse_header(raw)
        elif isinstance(raw, Mapping):
            mapping = raw
        else:
            raise SpecError("", f"expected a policy name or a mapping, got {raw!r}", "e.g. {policy: lagkv, ratio: 0.25}")
        spec = CompressionSpec.from_mapping(mapping)
        spec = spec.with_defaults(config.policies.get(spec.policy, {}))
    except SpecError as err:
        raise ConfigError(_join("default", err.field), err.message, err.allowed) from None
    if spec.policy not in config.allow:
        raise ConfigError("default.policy", f"{spec.policy!r} is not in allow", ", ".join(config.allow))
    kind = requires_profile(spec.policy)
    if kind is not None and kind not in config.profiles:
        raise ConfigError(
            "default.policy", f"{spec.policy!r} needs a {kind!r} calibration profile", f"set profiles.{kind}"
        )
    try:
        spec = config.bounds.admit(spec)
    except SpecError as err:
        raise ConfigError(f"default.{err.field}", err.message, err.allowed) from None
    return spec


def _policy_defaults(name: str, values: Mapping[str, Any]) -> dict[str, Scalar]:
    """Validate ``policies.<name>`` through CompressionSpec; the normalized, set fields."""
    if any(str(k).strip().lower() == "policy" for k in values):
        raise ConfigError(f"policies.{name}.policy", "the policy is the key above; remove this entry")
    try:
        spec = CompressionSpec.from_mapping({**values, "policy": name})
    except SpecError as err:
        raise ConfigError(f"policies.{name}.{err.field}", err.message, err.allowed) from None
    return {k: v for k, v in spec.to_dict().items() if k != "policy"}


def _profile_ref(kind: str, ref: str, source: str | None) -> str:
    """A profile name (``<model>/kvcomp_profiles/``) or a path, resolved from the config's folder."""
    if ref.endswith(".json") or "/" in ref:
        path = Path(ref)
        if not path.is_absolute() and source is not None:
            path = Path(source).resolve().parent / path
        return str(path)
    try:
        return check_name(ref)
    except ProfileError:
        raise ConfigError(
            f"profiles.{kind}",
            f"{ref!r} is neither a profile name nor a .json path",
            "lower-case letters, digits, '-', '_' (at most 64), or a path to a .json file",
        ) from None


def _check_bounds_order(bounds: Bounds) -> None:
    if bounds.min_ratio > bounds.max_ratio:
        raise ConfigError("bounds.min_ratio", f"{bounds.min_ratio:g} is above bounds.max_ratio {bounds.max_ratio:g}")
    if bounds.min_budget > bounds.max_budget:
        raise ConfigError("bounds.min_budget", f"{bounds.min_budget} is above bounds.max_budget {bounds.max_budget}")


def _config_error(err: ValidationError) -> ConfigError:
    """The first pydantic problem as a ConfigError with a YAML path (the rest counted)."""
    problems = err.errors()
    first = problems[0]
    loc = [str(p) for p in first["loc"]]
    message, allowed = first["msg"], None
    if first["type"] == "extra_forbidden":
        parent = Bounds if loc[:1] == ["bounds"] else _File
        message, allowed = "unknown key", ", ".join(parent.model_fields)
    elif first["type"] == "literal_error":
        what = "key" if loc[-1] == "[key]" else "value"
        message, allowed = f"unknown {what} {first['input']!r}", first["ctx"]["expected"]
    if loc[-1] == "[key]":
        loc.pop()
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more problem(s))"
    path = ".".join(f"[{p}]" if p.isdigit() else p for p in loc).replace(".[", "[")
    return ConfigError(path, message, allowed)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if name else prefix


def _param_schema(param: Param) -> dict[str, Any]:
    if param.choices:
        return {"enum": list(param.choices), "description": param.help}
    kind = {int: "integer", float: "number"}.get(param.kind, "string")
    out: dict[str, Any] = {"type": kind, "description": param.help}
    if param.low is not None:
        out["exclusiveMinimum" if param.name == "ratio" else "minimum"] = param.low
    if param.high is not None:
        out["maximum"] = param.high
    return out


def _policy_schema(name: str) -> dict[str, Any]:
    from vllm_kvcomp.policies.registry import get_policy_class

    params = get_policy_class(name).accepted_params()
    return {
        "type": "object",
        "properties": {key: _param_schema(p) for key, p in params.items()},
        "additionalProperties": False,
    }


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """Replace pydantic's ``$ref``/``$defs`` with the definitions themselves."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].rsplit("/", 1)[-1]]) | {k: walk(v) for k, v in node.items() if k != "$ref"}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# ---------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``check FILE...``: validate operator configs; ``schema``: print the JSON schema."""
    parser = argparse.ArgumentParser(prog="python -m vllm_kvcomp.server.operator_config")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate operator config files")
    check.add_argument("files", nargs="+")
    sub.add_parser("schema", help="print the JSON schema of the file")
    args = parser.parse_args(argv)
    if args.command == "schema":
        print(json.dumps(OperatorConfig.json_schema(), indent=2))
        return 0
    failed = 0
    for path in args.files:
        try:
            config = OperatorConfig.load(path)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            failed += 1
            continue
        default = config.default_spec.to_header() if config.default_spec.compresses else NO_COMPRESSION_WORDS[0]
        print(f"{path}: ok (default: {default}; usable: {', '.join(config.usable_policies())})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
