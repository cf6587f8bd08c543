"""Send samples to an OpenAI-compatible server under each compression condition; append JSONL.

Each request carries ``X-KV-Compression`` (``policy=full`` for the baseline), decodes greedily
with bounded ``max_tokens``, and yields one JSONL line per sample x condition. A line records the
replies, the score, the server's ``X-KV-Compression-Applied`` header and the ``kv_compression``
field of ``usage`` (per turn) when present. Lines whose key is already in the file (without an
error) are skipped, so an interrupted run resumes where it stopped; failed ones are retried.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from tqdm import tqdm

from vllm_kvcomp.eval.scoring import score_sample
from vllm_kvcomp.eval.tasks import TaskContext, generate, plan
from vllm_kvcomp.eval.tasks.base import Sample, sample_uid
from vllm_kvcomp.params import SpecError
from vllm_kvcomp.policies.registry import get_policy_class, policy_names

HEADER = "X-KV-Compression"
APPLIED_HEADER = "X-KV-Compression-Applied"


Setting = tuple[str, Any]
Scope = Literal["all", "context"]
SCOPES: tuple[Scope, ...] = ("all", "context")
#: settings a run sets for every condition (``--scope``), never per policy
RUN_WIDE = ("scope", "context_tokens")


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Condition:
    """One compression setting: a policy, its kept ratio (``None`` for ``full``) and any further
    settings sent in the header (``lag=64``), sorted by key, defaults left out; ``scope`` is the
    run's (``context``: the document and the question are separate messages, for every condition,
    and a compressing one compresses the document only)."""

    policy: str
    ratio: float | None = None
    params: tuple[Setting, ...] = ()
    scope: Scope = "all"

    @property
    def label(self) -> str:
        """``lagkv`` or ``lagkv:lag=64``: the policy column of the results (ratio excluded)."""
        return ":".join([self.policy, *(f"{k}={_text(v)}" for k, v in self.params)])

    @property
    def header(self) -> str:
        if self.ratio is None:
            return "policy=full"
        extra = "".join(f"; {k}={_text(v)}" for k, v in self.params)
        scope = "; scope=context" if self.scope == "context" else ""
        return f"policy={self.policy}; ratio={self.ratio:g}{extra}{scope}"

    @property
    def kept_ratio(self) -> float:
        """The requested kept fraction (1 for ``full``)."""
        return 1.0 if self.ratio is None else self.ratio


def parse_condition(text: str) -> tuple[str, float | None, tuple[Setting, ...]]:
    """``name[:key=value...]`` -> (policy, pinned ratio or None, settings).

    Keys are checked against the policy's :meth:`~vllm_kvcomp.policies.base.Policy.accepted_params`;
    ``ratio`` pins the condition to that ratio instead of every ``--ratios`` value; settings equal
    to the policy's default are dropped, so ``lagkv:lag=128`` is the same condition as ``lagkv``.
    """
    name, *parts = [p.strip() for p in text.strip().split(":")]
    name = "full" if name.lower() == "none" else name.lower()
    if name not in policy_names():
        raise ValueError(f"unknown policy {text!r} (allowed: {', '.join(policy_names())})")
    cls = get_policy_class(name)
    accepted = cls.accepted_params()
    defaults = {f.name: f.default for f in fields(cls)}
    settings: dict[str, Any] = {}
    for part in parts:
        key, sep, value = (x.strip() for x in part.partition("="))
        key = key.lower()
        if not sep or not key or not value:
            raise ValueError(f"bad setting {part!r} in {text!r} (expected key=value)")
        if key in RUN_WIDE:
            raise ValueError(f"{text!r}: {key} is set for the whole run (--scope), not per policy")
        if key not in accepted or key == "budget":
            allowed = ", ".join(k for k in accepted if k != "budget" and k not in RUN_WIDE) or "none"
            raise ValueError(f"{name} does not take {key!r} here (allowed: {allowed})")
        try:
            settings[key] = accepted[key].coerce(value)
        except SpecError as err:
            raise ValueError(f"{text!r}: {err}") from None
    try:
        cls.from_settings(settings)  # the policy's own cross-field checks, as the server runs them
    except SpecError as err:
        raise ValueError(f"{text!r}: {err}") from None
    ratio = settings.pop("ratio", None)
    params = tuple(sorted((k, v) for k, v in settings.items() if v != defaults.get(k)))
    return name, ratio, params


def conditions(policies: Sequence[str], ratios: Sequence[float], scope: Scope = "all") -> list[Condition]:
    """Every policy at every ratio; ``full`` (or ``none``) once; ``name:ratio=r`` only at r; all in
    ``scope``.

    Entries may carry settings (``lagkv:lag=64``, see :func:`parse_condition`). Invalid input
    raises ValueError.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    bad = [r for r in ratios if not 0.0 < r <= 1.0]
    if bad:
        raise ValueError(f"ratios must be in (0, 1] (fraction of tokens kept), got {bad}")
    out: list[Condition] = []
    for raw in policies:
        name, pinned, params = parse_condition(raw)
        if pinned is not None and not 0.0 < pinned <= 1.0:
            raise ValueError(f"{raw!r}: ratio must be in (0, 1] (fraction of tokens kept)")
        if name == "full":
            if params or pinned is not None:
                raise ValueError(f"{raw!r}: full takes no settings")
            new = [Condition("full", scope=scope)]
        elif pinned is not None:
            new = [Condition(name, pinned, params, scope)]
        elif not ratios:
            raise ValueError(f"policy {name!r} needs at least one ratio")
        else:
            new = [Condition(name, r, params, scope) for r in ratios]
        out.extend(c for c in new if c not in out)
    return out


@dataclass(frozen=True)
class Settings:
    """Where and how to send requests."""

    url: str
    model: str
    api_key: str = "EMPTY"
    api: Literal["chat", "completions"] = "chat"
    max_tokens: int | None = None
    concurrency: int = 4
    timeout: float = 600.0
    max_errors: int = 10


def record_key(model: str, uid: str, condition: Condition) -> str:
    """Resume key of one JSONL line (a condition without settings keys by its policy name; the
    context scope's keys end in ``|context``)."""
    scope = "|context" if condition.scope == "context" else ""
    return f"{model}|{uid}|{condition.label}|{condition.kept_ratio:g}{scope}"


def base_url(url: str) -> str:
    """``http://host:port`` or ``.../v1`` -> the ``/v1`` base the OpenAI SDK expects."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All well-formed JSON object lines of ``path`` (a torn last line is ignored)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out


def done_keys(path: Path) -> set[str]:
    """Keys of the lines already written without an error."""
    return {r["key"] for r in read_jsonl(path) if "key" in r and not r.get("error")}


class JsonlAppender:
    """Thread-safe line appender; starts on a fresh line if the file ends mid-line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a+b")
        if self._file.tell() > 0:
            self._file.seek(-1, os.SEEK_END)
            if self._file.read(1) != b"\n":
                self._file.write(b"\n")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
            self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class Reply:
    """What one request returned."""

    text: str
    applied: str | None
    kv_compression: Any
    prompt_tokens: int | None
    completion_tokens: int | None


def kept_fraction(kv_compression: Any, applied: str | None) -> float | None:
    """The kept fraction the server reports: ``usage.kv_compression.kept_fraction`` (or
    ``kept_tokens / prompt_tokens`` there), else ``kept_fraction=...`` in the applied header."""
    if isinstance(kv_compression, dict):
        value = kv_compression.get("kept_fraction")
        if isinstance(value, int | float):
            return float(value)
        kept, total = kv_compression.get("kept_tokens"), kv_compression.get("prompt_tokens")
        if isinstance(kept, int | float) and isinstance(total, int | float) and total > 0:
            return kept / total
    for part in (applied or "").split(";"):
        key, _, value = part.partition("=")
        if key.strip().lower() == "kept_fraction":
            try:
                return float(value)
            except ValueError:
                return None
    return None


def render_plain(messages: Sequence[dict[str, str]], answer_start: str | None = None) -> str:
    """Messages as one completion prompt (``--api completions``), ending with the start of the
    answer when the task gives one (a base model continues it)."""
    body = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    return body + "\n\nAssistant:" + (f" {answer_start}" if answer_start else "")


def ask(client: Any, settings: Settings, messages: list[dict[str, str]], max_tokens: int,
        header: str, answer_start: str | None = None) -> Reply:
    """One greedy request with the compression header (``answer_start``: completions only)."""
    common = {"model": settings.model, "max_tokens": max_tokens, "temperature": 0.0,
              "extra_headers": {HEADER: header}}
    if settings.api == "chat":
        raw = client.chat.completions.with_raw_response.create(messages=messages, **common)
        response = raw.parse()
        text = response.choices[0].message.content or ""
    else:
        raw = client.completions.with_raw_response.create(prompt=render_plain(messages, answer_start), **common)
        response = raw.parse()
        text = response.choices[0].text or ""
    usage = response.usage
    extra = (usage.model_extra or {}) if usage is not None else {}
    return Reply(text, raw.headers.get(APPLIED_HEADER), extra.get("kv_compression"),
                 usage.prompt_tokens if usage else None, usage.completion_tokens if usage else None)


def evaluate(client: Any, settings: Settings, sample: Sample, condition: Condition) -> dict[str, Any]:
    """Run every turn of ``sample`` (later turns carry the earlier replies) and score it."""
    record: dict[str, Any] = {
        "key": record_key(settings.model, sample.uid, condition), "model": settings.model,
        "task": sample.task, "index": sample.index, "seed": sample.seed, "length": sample.length,
        "tokens": sample.tokens, "depth": sample.depth, "policy": condition.policy,
        "condition": condition.label, "params": dict(condition.params),
        "ratio": condition.kept_ratio, "header": condition.header, "scope": condition.scope,
        "answers": [list(t.answers) for t in sample.turns],
    }
    start = time.perf_counter()
    messages: list[dict[str, str]] = []
    replies: list[Reply] = []
    try:
        for turn in sample.turns:
            messages.extend(turn.messages(split=condition.scope == "context"))
            reply = ask(client, settings, messages, settings.max_tokens or sample.max_tokens,
                        condition.header, turn.answer_start)
            messages.append({"role": "assistant", "content": reply.text})
            replies.append(reply)
    except Exception as err:  # any transport / HTTP failure is recorded and retried on resume
        record.update(error=f"{type(err).__name__}: {err}", latency_s=time.perf_counter() - start)
        return record
    score = score_sample(sample, [r.text for r in replies])
    kept = [kept_fraction(r.kv_compression, r.applied) for r in replies]
    known = [k for k in kept if k is not None]
    if not known and condition.ratio is None:
        known = [1.0]  # full keeps everything even when the server reports nothing
    record.update(
        replies=[r.text for r in replies], score=score.score, exact=score.exact,
        details=score.details, applied=[r.applied for r in replies],
        kv_compression=[r.kv_compression for r in replies],
        kept_fraction=sum(known) / len(known) if known else None,
        prompt_tokens=[r.prompt_tokens for r in replies],
        completion_tokens=[r.completion_tokens for r in replies],
        latency_s=time.perf_counter() - start, error=None,
    )
    return record


def make_client(settings: Settings) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base_url(settings.url), api_key=settings.api_key,
                  timeout=settings.timeout, max_retries=2)


@dataclass(frozen=True)
class RunStats:
    sent: int
    skipped: int
    errors: int
    keys: frozenset[str]


Item = tuple[str, int, int]
#: (task, length, index) of a sample and the conditions it runs under
Work = list[tuple[Item, list[Condition]]]


def schedule(tasks: Sequence[str], lengths: Sequence[int], conds: Sequence[Condition], samples: int,
             extra: Callable[[str, Condition], int] | None = None) -> Work:
    """Sample-major work list: every (task, condition) gets ``samples`` samples, or more where
    ``extra(task, condition)`` asks for more (claim cells).

    Sample-major means index 0 of every cell first, then index 1, ...: an interrupted run leaves
    every cell with about the same number of samples. Unknown tasks raise ValueError.
    """
    plan(tasks, lengths, 1)  # validates the task names
    counts = {(t, c): max(samples, extra(t, c) if extra else 0) for t in tasks for c in conds}
    work: Work = []
    for index in range(max(counts.values(), default=0)):
        for task in tasks:
            wanted = [c for c in conds if index < counts[(task, c)]]
            work.extend(((task, length, index), wanted) for length in lengths if wanted)
    return work


def run(ctx: TaskContext, items: Sequence[Item], conds: Sequence[Condition],
        settings: Settings, out: Path, client: Any = None) -> RunStats:
    """Every sample in ``items`` (task, length, index) under every condition: :func:`run_work`."""
    return run_work(ctx, [(item, list(conds)) for item in items], settings, out, client)


def _pending(ctx: TaskContext, work: Work, model: str, done: set[str]) -> tuple[Work, set[str]]:
    """The part of ``work`` not in ``done`` yet, and every key of ``work``."""
    keys: set[str] = set()
    todo: Work = []
    for (task, length, index), conds in work:
        uid = sample_uid(task, length, ctx.seed, index)
        wanted = {c: record_key(model, uid, c) for c in conds}
        keys.update(wanted.values())
        pending = [c for c, k in wanted.items() if k not in done]
        if pending:
            todo.append(((task, length, index), pending))
    return todo, keys


def run_work(ctx: TaskContext, work: Work, settings: Settings, out: Path,
             client: Any = None) -> RunStats:
    """Generate the samples in ``work`` that still have conditions to run and send them, in
    order, ``settings.concurrency`` at a time; lines already in ``out`` are skipped (resume).

    Raises RuntimeError once more than ``settings.max_errors`` requests have failed.
    """
    todo, keys = _pending(ctx, work, settings.model, done_keys(out))
    skipped = len(keys) - sum(len(p) for _, p in todo)
    pairs = [(generate(ctx, *item), c)
             for item, pending in tqdm(todo, desc="generate", unit="sample", leave=False)
             for c in pending]
    client = client or (make_client(settings) if pairs else None)
    writer = JsonlAppender(out)
    errors = 0
    try:
        with ThreadPoolExecutor(max_workers=max(1, settings.concurrency)) as pool, \
                tqdm(total=len(keys), initial=skipped, desc="eval", unit="sample") as bar:
            futures: list[Future[dict[str, Any]]] = [
                pool.submit(evaluate, client, settings, s, c) for s, c in pairs]
            for future in as_completed(futures):
                record = future.result()
                writer.write(record)
                bar.update()
                if record.get("error"):
                    errors += 1
                    bar.set_postfix(errors=errors)
                    if errors > settings.max_errors:
                        for f in futures:
                            f.cancel()
                        raise RuntimeError(f"stopped after {errors} failed requests; last: "
                                           f"{record['error']}")
    finally:
        writer.close()
    return RunStats(len(pairs), skipped, errors, frozenset(keys))
