"""Calibration profiles: per-model JSON files that policies load by name.

A profile lives in the model folder as ``<model>/kvcomp_profiles/<kind>.json`` (name
``"default"``) or ``<kind>.<name>.json`` (any other name), in the package's store
(``calibration/store/<model_type>-<config_hash>/``: the bundled model's profiles ship there and
are found for any copy of that model), or at an explicit path. Every file records the identity
of the model it was measured on (architecture numbers + a hash of them) and is validated on
load, so a profile can never be applied to a model of another shape.

Kinds: ``"razor"`` (:class:`RetrievalHeadsProfile`, RazorAttention retrieval heads),
``"pod"`` (:class:`LayerGroupsProfile`, POD layer groups), ``"duoattention"``
(:class:`HeadGatesProfile`, DuoAttention's trained retrieval/streaming gates) and ``"kvzap"``
(:class:`ScorerProfile`, a linear model per layer and KV head predicting KVzip's scores).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

FORMAT = "vllm-kvcomp-profile"
VERSION = 1
PROFILE_DIRNAME = "kvcomp_profiles"
#: profiles shipped with the package (the bundled model's), one folder per model identity
STORE = Path(__file__).resolve().parent / "store"
DEFAULT_NAME = "default"
KINDS = ("razor", "pod", "duoattention", "kvzap")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
# Config keys that fix the attention geometry; dtype, paths and versions are left out on purpose.
_IDENTITY_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


class ProfileError(ValueError):
    """A profile is missing, malformed, or measured on another model."""


def check_name(name: str) -> str:
    """Validate a profile name (lower-case letters, digits, ``-``, ``_``; at most 64)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ProfileError(
            f"profile name {name!r} is invalid (allowed: lower-case letters, digits, '-' and '_', "
            "starting with a letter or digit, at most 64 characters)"
        )
    return name


# ---------------------------------------------------------------------------- model identity


@dataclass(frozen=True)
class ModelIdentity:
    """The architecture numbers a profile depends on, plus a hash of the geometry config keys."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    config_hash: str

    @classmethod
    def from_config(cls, config: Any) -> ModelIdentity:
        """From an HF ``PretrainedConfig`` or a ``config.json`` dict."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        if get("num_hidden_layers") is None or get("num_attention_heads") is None:
            raise ProfileError("model config has no num_hidden_layers / num_attention_heads")
        values = {k: get(k) for k in _IDENTITY_KEYS}
        heads = int(values["num_attention_heads"])
        values["num_key_value_heads"] = int(values["num_key_value_heads"] or heads)
        values["head_dim"] = int(values["head_dim"] or int(values["hidden_size"]) // heads)
        blob = json.dumps(values, sort_keys=True, default=str).encode()
        return cls(
            model_type=str(values["model_type"]),
            num_layers=int(values["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=values["num_key_value_heads"],
            head_dim=values["head_dim"],
            config_hash=hashlib.sha256(blob).hexdigest()[:16],
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelIdentity:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ProfileError(f"{path} not found: not a Hugging Face model folder")
        return cls.from_config(json.loads(path.read_text()))

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "config_hash": self.config_hash,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelIdentity:
        try:
            return cls(
                model_type=str(data["model_type"]),
                num_layers=_int(data["num_layers"], "model.num_layers"),
                num_heads=_int(data["num_heads"], "model.num_heads"),
                num_kv_heads=_int(data["num_kv_heads"], "model.num_kv_heads"),
                head_dim=_int(data["head_dim"], "model.head_dim"),
                config_hash=str(data["config_hash"]),
            )
        except KeyError as err:
            raise ProfileError(f"profile 'model' lacks the key {err.args[0]!r}") from None

    def check_matches(self, other: ModelIdentity, source: str = "profile") -> None:
        """Raise ProfileError naming every field where ``other`` (the live model) differs."""
        diffs = [
            f"{k}: {source} has {getattr(self, k)!r}, model has {getattr(other, k)!r}"
            for k in ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "config_hash")
            if getattr(self, k) != getattr(other, k)
        ]
        if diffs:
            raise ProfileError(
                f"{source} was calibrated for another model ({'; '.join(diffs)}); "
                "re-run `vllm-kvcomp calibrate` for this model"
            )


# ---------------------------------------------------------------------------- profiles


@dataclass(frozen=True)
class RetrievalHeadsProfile:
    """RazorAttention retrieval heads of one model (003_… §3.3).

    ``kv_heads`` are the (layer, kv_head) pairs that keep their full cache; ``induction_heads`` and
    ``echo_heads`` the selected (layer, query_head) pairs; ``*_scores`` [L][H_q] the measured scores.
    """

    kind: ClassVar[str] = "razor"

    model: ModelIdentity
    kv_heads: frozenset[tuple[int, int]]
    induction_heads: frozenset[tuple[int, int]] = frozenset()
    echo_heads: frozenset[tuple[int, int]] = frozenset()
    induction_scores: tuple[tuple[float, ...], ...] = ()
    echo_scores: tuple[tuple[float, ...], ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    name: str = DEFAULT_NAME

    def validate(self) -> None:
        m = self.model
        _check_pairs(self.kv_heads, m.num_layers, m.num_kv_heads, "kv_heads")
        _check_pairs(self.induction_heads, m.num_layers, m.num_heads, "induction_heads")
        _check_pairs(self.echo_heads, m.num_layers, m.num_heads, "echo_heads")
        for key in ("induction_scores", "echo_scores"):
            table = getattr(self, key)
            if table and (len(table) != m.num_layers or any(len(r) != m.num_heads for r in table)):
                raise ProfileError(f"{key} must be {m.num_layers} rows of {m.num_heads} scores")
        implied = {(layer, q // m.group_size) for layer, q in self.induction_heads | self.echo_heads}
        if not implied <= self.kv_heads:
            raise ProfileError(f"kv_heads misses the KV heads of selected query heads: {sorted(implied - self.kv_heads)}")

    def data(self) -> dict[str, Any]:
        return {
            "kv_heads": sorted(list(p) for p in self.kv_heads),
            "induction_heads": sorted(list(p) for p in self.induction_heads),
            "echo_heads": sorted(list(p) for p in self.echo_heads),
            "induction_scores": [list(r) for r in self.induction_scores],
            "echo_scores": [list(r) for r in self.echo_scores],
        }

    @classmethod
    def from_data(cls, model: ModelIdentity, data: Mapping[str, Any], **common: Any) -> RetrievalHeadsProfile:
        return cls(
            model=model,
            kv_heads=_pairs(data.get("kv_heads"), "kv_heads"),
            induction_heads=_pairs(data.get("induction_heads", []), "induction_heads"),
            echo_heads=_pairs(data.get("echo_heads", []), "echo_heads"),
            induction_scores=_table(data.get("induction_scores", []), "induction_scores"),
            echo_scores=_table(data.get("echo_scores", []), "echo_scores"),
            **common,
        )


@dataclass(frozen=True)
class LayerGroupsProfile:
    """POD layer groups of one model (004_… §2.1): consecutive layers sharing distant scores.

    ``groups`` partitions ``range(num_layers)`` into consecutive blocks; ``similarity`` [L][L] is
    the head-averaged ``1 - JS`` similarity the greedy grouping used with threshold ``delta``.
    """

    kind: ClassVar[str] = "pod"

    model: ModelIdentity
    groups: tuple[tuple[int, ...], ...]
    delta: float = 0.5
    similarity: tuple[tuple[float, ...], ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    name: str = DEFAULT_NAME

    def validate(self) -> None:
        check_groups(self.groups, self.model.num_layers)
        if not 0.0 <= self.delta <= 1.0:
            raise ProfileError(f"delta must be in [0, 1], got {self.delta}")
        n = self.model.num_layers
        if self.similarity and (len(self.similarity) != n or any(len(r) != n for r in self.similarity)):
            raise ProfileError(f"similarity must be {n} x {n}")

    def data(self) -> dict[str, Any]:
        return {
            "groups": [list(g) for g in self.groups],
            "delta": self.delta,
            "similarity": [list(r) for r in self.similarity],
        }

    @classmethod
    def from_data(cls, model: ModelIdentity, data: Mapping[str, Any], **common: Any) -> LayerGroupsProfile:
        raw = data.get("groups")
        if not isinstance(raw, list):
            raise ProfileError("data.groups must be a list of lists of layer indices")
        groups = tuple(tuple(_int(x, "data.groups") for x in _list(g, "data.groups")) for g in raw)
        delta = data.get("delta", 0.5)
        if isinstance(delta, bool) or not isinstance(delta, int | float):
            raise ProfileError(f"data.delta must be a number, got {delta!r}")
        return cls(
            model=model,
            groups=groups,
            delta=float(delta),
            similarity=_table(data.get("similarity", []), "similarity"),
            **common,
        )


@dataclass(frozen=True)
class HeadGatesProfile:
    """DuoAttention gates of one model (Xiao et al. 2024, §3.2): per (layer, KV head) the trained
    α ∈ [0, 1] mixing full and streaming attention (``gates`` [L][H_kv], high = retrieval head).
    ``threshold``: a head is a retrieval head when its gate is at least this (the authors' default
    0.5), unless a policy asks for a share of streaming heads instead."""

    kind: ClassVar[str] = "duoattention"

    model: ModelIdentity
    gates: tuple[tuple[float, ...], ...]
    threshold: float = 0.5
    settings: Mapping[str, Any] = field(default_factory=dict)
    name: str = DEFAULT_NAME

    def validate(self) -> None:
        m = self.model
        if len(self.gates) != m.num_layers or any(len(r) != m.num_kv_heads for r in self.gates):
            raise ProfileError(f"gates must be {m.num_layers} rows of {m.num_kv_heads} values (one per KV head)")
        if any(not 0.0 <= g <= 1.0 for row in self.gates for g in row):
            raise ProfileError("gates must lie in [0, 1]")
        if not 0.0 <= self.threshold <= 1.0:
            raise ProfileError(f"threshold must be in [0, 1], got {self.threshold}")

    def data(self) -> dict[str, Any]:
        return {"gates": [list(r) for r in self.gates], "threshold": self.threshold}

    @classmethod
    def from_data(cls, model: ModelIdentity, data: Mapping[str, Any], **common: Any) -> HeadGatesProfile:
        threshold = data.get("threshold", 0.5)
        if isinstance(threshold, bool) or not isinstance(threshold, int | float):
            raise ProfileError(f"data.threshold must be a number, got {threshold!r}")
        return cls(model=model, gates=_table(data.get("gates"), "gates"), threshold=float(threshold), **common)


@dataclass(frozen=True)
class ScorerProfile:
    """A ``kvzap`` scorer of one model: per (layer, KV head) a linear model over a token's cache
    features (its value, then its key's rotary-pair norms: 3D/2 numbers,
    :func:`vllm_kvcomp.policies.kvzap.cache_features`) predicting the log of its KVzip score;
    ``weights`` [L][H_kv][3D/2], ``bias`` [L][H_kv]. ``settings`` records how it was trained and
    its fit on held-out text (``r2``)."""

    kind: ClassVar[str] = "kvzap"

    model: ModelIdentity
    weights: tuple[tuple[tuple[float, ...], ...], ...]
    bias: tuple[tuple[float, ...], ...]
    settings: Mapping[str, Any] = field(default_factory=dict)
    name: str = DEFAULT_NAME

    def validate(self) -> None:
        m = self.model
        features = m.head_dim + m.head_dim // 2
        if len(self.weights) != m.num_layers or any(len(layer) != m.num_kv_heads for layer in self.weights) \
                or any(len(head) != features for layer in self.weights for head in layer):
            raise ProfileError(f"weights must be {m.num_layers} layers of {m.num_kv_heads} KV heads of {features} "
                               "numbers (head_dim + head_dim / 2)")
        if len(self.bias) != m.num_layers or any(len(r) != m.num_kv_heads for r in self.bias):
            raise ProfileError(f"bias must be {m.num_layers} rows of {m.num_kv_heads} values (one per KV head)")
        if not all(math.isfinite(x) for layer in self.weights for head in layer for x in head) \
                or not all(math.isfinite(x) for row in self.bias for x in row):
            raise ProfileError("weights and bias must be finite numbers")

    def data(self) -> dict[str, Any]:
        return {"weights": [[list(head) for head in layer] for layer in self.weights],
                "bias": [list(r) for r in self.bias]}

    @classmethod
    def from_arrays(cls, model: ModelIdentity, weights: Any, bias: Any, **common: Any) -> ScorerProfile:
        """From ``weights`` [L][H_kv][3D/2] and ``bias`` [L][H_kv] (tensors or nested lists), each
        number to 7 significant digits (float32's precision, what the scorer multiplies in; half
        the JSON of float64's digits)."""
        def nested(x: Any) -> Any:
            return tuple(nested(v) for v in x) if isinstance(x, list) else float(f"{x:.7g}")

        def as_list(a: Any) -> Any:
            return a.tolist() if hasattr(a, "tolist") else a

        return cls(model=model, weights=nested(as_list(weights)), bias=nested(as_list(bias)), **common)

    @classmethod
    def from_data(cls, model: ModelIdentity, data: Mapping[str, Any], **common: Any) -> ScorerProfile:
        layers = _list(data.get("weights"), "data.weights")
        weights = tuple(_table(layer, "weights") for layer in layers)
        return cls(model=model, weights=weights, bias=_table(data.get("bias"), "bias"), **common)


Profile = RetrievalHeadsProfile | LayerGroupsProfile | HeadGatesProfile | ScorerProfile
_CLASSES: dict[str, type[Profile]] = {
    "razor": RetrievalHeadsProfile,
    "pod": LayerGroupsProfile,
    "duoattention": HeadGatesProfile,
    "kvzap": ScorerProfile,
}


def check_groups(groups: Any, num_layers: int) -> tuple[tuple[int, ...], ...]:
    """Validate that ``groups`` partitions ``range(num_layers)`` into consecutive ascending blocks."""
    flat = [layer for g in groups for layer in g]
    if any(len(g) == 0 for g in groups) or flat != list(range(num_layers)):
        raise ProfileError(
            f"groups must split layers 0..{num_layers - 1} into consecutive non-empty blocks in order, "
            f"got {[list(g) for g in groups]}"
        )
    return tuple(tuple(int(x) for x in g) for g in groups)


def compressed_layers(layer_types: Any) -> list[int] | None:
    """The layers the engine compresses when a model's config names each layer's attention
    (``layer_types``, e.g. Gemma 3: its full-attention ones; the sliding-window layers stay
    vLLM's); None: every layer (no ``layer_types``)."""
    if not layer_types:
        return None
    return [i for i, kind in enumerate(layer_types) if kind == "full_attention"]


# ---------------------------------------------------------------------------- files


def profile_path(model_dir: str | Path, kind: str, name: str = DEFAULT_NAME) -> Path:
    """``<model_dir>/kvcomp_profiles/<kind>.json`` for the default name, else ``<kind>.<name>.json``."""
    _check_kind(kind)
    check_name(name)
    stem = kind if name == DEFAULT_NAME else f"{kind}.{name}"
    return Path(model_dir) / PROFILE_DIRNAME / f"{stem}.json"


def store_dir(model: ModelIdentity) -> Path:
    """The package's profile store folder for a model (profiles shipped with vllm-kvcomp, found by
    the model's architecture identity, so a copy of the model anywhere uses them)."""
    return STORE / f"{model.model_type}-{model.config_hash}"


def find_profile(kind: str, model_dir: str | Path, name: str = DEFAULT_NAME) -> Path | None:
    """Where the ``kind`` profile ``name`` of the model in ``model_dir`` is: the model folder's
    ``kvcomp_profiles/`` first, then the package store; None if neither has it."""
    local = profile_path(model_dir, kind, name)
    if local.is_file():
        return local
    try:
        shipped = store_dir(ModelIdentity.from_model_dir(model_dir)) / local.name
    except ProfileError:  # not a local HF folder (e.g. a hub name): only the folder can hold it
        return None
    return shipped if shipped.is_file() else None


def available_profiles(model_dir: str | Path) -> dict[str, str]:
    """Kind -> ``default`` for every kind whose default profile exists for this model."""
    return {kind: DEFAULT_NAME for kind in KINDS if find_profile(kind, model_dir) is not None}


def calibrate_command(model_dir: str | Path, kind: str, name: str = DEFAULT_NAME) -> str:
    """The command that creates a missing profile."""
    return f"vllm-kvcomp calibrate --model {model_dir} --kind {kind}" + ("" if name == DEFAULT_NAME else f" --name {name}")


def to_json(profile: Profile) -> dict[str, Any]:
    profile.validate()
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": profile.kind,
        "name": profile.name,
        "model": profile.model.to_dict(),
        "settings": dict(profile.settings),
        "data": profile.data(),
    }


def from_json(doc: Any, source: str = "profile") -> Profile:
    """Parse and validate a profile document; ProfileError says what is wrong and where."""
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
        raise ProfileError(f"{source} is not a vllm-kvcomp profile (missing \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise ProfileError(f"{source} has version {doc.get('version')!r}; this build reads version {VERSION}")
    kind = doc.get("kind")
    _check_kind(kind, source)
    if not isinstance(doc.get("model"), Mapping) or not isinstance(doc.get("data"), Mapping):
        raise ProfileError(f"{source} needs objects 'model' and 'data'")
    settings = doc.get("settings", {})
    if not isinstance(settings, Mapping):
        raise ProfileError(f"{source}: 'settings' must be an object")
    common = {"settings": dict(settings), "name": check_name(doc.get("name", DEFAULT_NAME))}
    try:
        profile = _CLASSES[kind].from_data(ModelIdentity.from_dict(doc["model"]), doc["data"], **common)
        profile.validate()
    except ProfileError as err:
        raise ProfileError(f"{source}: {err}") from None
    return profile


def save_profile(profile: Profile, model_dir: str | Path | None = None, path: str | Path | None = None) -> Path:
    """Write ``profile`` to ``path``, or to :func:`profile_path` in ``model_dir``; returns the path."""
    if (model_dir is None) == (path is None):
        raise ValueError("give exactly one of model_dir or path")
    target = Path(path) if path is not None else profile_path(model_dir, profile.kind, profile.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_json(profile), indent=1, sort_keys=False)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(target)
    return target


def load_profile(
    kind: str,
    model_dir: str | Path | None = None,
    name: str = DEFAULT_NAME,
    path: str | Path | None = None,
    expect: ModelIdentity | None = None,
) -> Profile:
    """Load the ``kind`` profile called ``name`` from ``model_dir`` (or from ``path``).

    The profile's model identity is checked against ``expect`` if given, else against the
    ``config.json`` of ``model_dir`` when loading from a model folder.
    """
    _check_kind(kind)
    if (model_dir is None) == (path is None):
        raise ValueError("give exactly one of model_dir or path")
    target = Path(path) if path is not None else find_profile(kind, model_dir, name)
    if target is None or not target.is_file():
        where = path if path is not None else profile_path(model_dir, kind, name)
        command = calibrate_command(model_dir, kind, name) if model_dir is not None else "vllm-kvcomp calibrate"
        raise ProfileError(f"no {kind} profile {name!r} at {where}; create it with `{command}`")
    try:
        doc = json.loads(target.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ProfileError(f"{target}: cannot read JSON ({err})") from None
    profile = from_json(doc, source=str(target))
    if profile.kind != kind:
        raise ProfileError(f"{target} holds a {profile.kind!r} profile, expected {kind!r}")
    if expect is None and model_dir is not None:
        expect = ModelIdentity.from_model_dir(model_dir)
    if expect is not None:
        profile.model.check_matches(expect, source=str(target))
    return profile


# ---------------------------------------------------------------------------- binding


def bind_profile(policy: Any, profile: Profile) -> Any:
    """Return ``policy`` with its structured calibration data filled from ``profile``.

    Policies that need no profile (``PROFILE is None``) come back unchanged.
    """
    wanted = getattr(policy, "PROFILE", None)
    if wanted is None:
        return policy
    if wanted != profile.kind:
        raise ProfileError(f"policy {policy.name!r} needs a {wanted!r} profile, got {profile.kind!r}")
    if isinstance(profile, RetrievalHeadsProfile):
        return replace(policy, retrieval_heads=profile.kv_heads)
    if isinstance(profile, HeadGatesProfile):
        return replace(policy, gates=profile.gates, threshold=profile.threshold)
    if isinstance(profile, ScorerProfile):
        return replace(policy, weights=profile.weights, bias=profile.bias)
    return replace(policy, groups=profile.groups)


def load_for_policy(policy: Any, model_dir: str | Path, expect: ModelIdentity | None = None) -> Any:
    """Load the profile a policy asks for (its ``PROFILE`` kind, its ``profile`` name) and bind it."""
    kind = getattr(policy, "PROFILE", None)
    if kind is None:
        return policy
    name = getattr(policy, "profile", DEFAULT_NAME) or DEFAULT_NAME
    return bind_profile(policy, load_profile(kind, model_dir=model_dir, name=name, expect=expect))


# ---------------------------------------------------------------------------- parsing helpers


def _check_kind(kind: Any, source: str = "kind") -> None:
    if kind not in KINDS:
        raise ProfileError(f"{source}: unknown profile kind {kind!r} (allowed: {', '.join(KINDS)})")


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"{where} must be an integer, got {value!r}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProfileError(f"{where} must be a list, got {value!r}")
    return value


def _pairs(value: Any, where: str) -> frozenset[tuple[int, int]]:
    out = set()
    for item in _list(value, f"data.{where}"):
        pair = _list(item, f"data.{where}")
        if len(pair) != 2:
            raise ProfileError(f"data.{where} entries must be [layer, head] pairs, got {item!r}")
        out.add((_int(pair[0], f"data.{where}"), _int(pair[1], f"data.{where}")))
    return frozenset(out)


def _table(value: Any, where: str) -> tuple[tuple[float, ...], ...]:
    rows = []
    for row in _list(value, f"data.{where}"):
        cells = _list(row, f"data.{where}")
        if any(isinstance(c, bool) or not isinstance(c, int | float) for c in cells):
            raise ProfileError(f"data.{where} must hold numbers")
        rows.append(tuple(float(c) for c in cells))
    return tuple(rows)


def _check_pairs(pairs: frozenset[tuple[int, int]], num_layers: int, num_heads: int, where: str) -> None:
    bad = sorted(p for p in pairs if not (0 <= p[0] < num_layers and 0 <= p[1] < num_heads))
    if bad:
        raise ProfileError(
            f"{where} has (layer, head) pairs outside {num_layers} layers x {num_heads} heads: {bad[:5]}"
        )
