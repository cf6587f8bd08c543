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
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tqdm import tqdm

from vllm_kvcomp.eval.scoring import score_sample
from vllm_kvcomp.eval.tasks import TaskContext, generate
from vllm_kvcomp.eval.tasks.base import Sample, sample_uid
from vllm_kvcomp.policies.registry import POLICY_NAMES

HEADER = "X-KV-Compression"
APPLIED_HEADER = "X-KV-Compression-Applied"


@dataclass(frozen=True)
class Condition:
    """One compression setting: a policy and its kept ratio (``None`` for ``full``)."""

    policy: str
    ratio: float | None = None

    @property
    def header(self) -> str:
        if self.ratio is None:
            return "policy=full"
        return f"policy={self.policy}; ratio={self.ratio:g}"

    @property
    def kept_ratio(self) -> float:
        """The requested kept fraction (1 for ``full``)."""
        return 1.0 if self.ratio is None else self.ratio


def conditions(policies: Sequence[str], ratios: Sequence[float]) -> list[Condition]:
    """Every policy at every ratio; ``full`` (or ``none``) once. Invalid input raises ValueError."""
    bad = [r for r in ratios if not 0.0 < r <= 1.0]
    if bad:
        raise ValueError(f"ratios must be in (0, 1] (fraction of tokens kept), got {bad}")
    out: list[Condition] = []
    for raw in policies:
        name = raw.strip().lower()
        name = "full" if name == "none" else name
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {raw!r} (allowed: {', '.join(POLICY_NAMES)})")
        if name != "full" and not ratios:
            raise ValueError(f"policy {name!r} needs at least one ratio")
        new = [Condition("full")] if name == "full" else [Condition(name, r) for r in ratios]
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
    """Resume key of one JSONL line."""
    return f"{model}|{uid}|{condition.policy}|{condition.kept_ratio:g}"


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


def render_plain(messages: Sequence[dict[str, str]]) -> str:
    """Messages as one completion prompt (``--api completions``)."""
    body = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    return body + "\n\nAssistant:"


def ask(client: Any, settings: Settings, messages: list[dict[str, str]], max_tokens: int,
        header: str) -> Reply:
    """One greedy request with the compression header."""
    common = {"model": settings.model, "max_tokens": max_tokens, "temperature": 0.0,
              "extra_headers": {HEADER: header}}
    if settings.api == "chat":
        raw = client.chat.completions.with_raw_response.create(messages=messages, **common)
        response = raw.parse()
        text = response.choices[0].message.content or ""
    else:
        raw = client.completions.with_raw_response.create(prompt=render_plain(messages), **common)
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
        "ratio": condition.kept_ratio, "header": condition.header,
        "answers": [list(t.answers) for t in sample.turns],
    }
    start = time.perf_counter()
    messages: list[dict[str, str]] = []
    replies: list[Reply] = []
    try:
        for turn in sample.turns:
            messages.append({"role": "user", "content": turn.user})
            reply = ask(client, settings, messages, settings.max_tokens or sample.max_tokens,
                        condition.header)
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


def run(ctx: TaskContext, items: Sequence[tuple[str, int, int]], conds: Sequence[Condition],
        settings: Settings, out: Path, client: Any = None) -> RunStats:
    """Generate the samples in ``items`` (task, length, index) that still have work and send them.

    Raises RuntimeError once more than ``settings.max_errors`` requests have failed.
    """
    done = done_keys(out)
    keys: set[str] = set()
    todo: list[tuple[tuple[str, int, int], list[Condition]]] = []
    for task, length, index in items:
        uid = sample_uid(task, length, ctx.seed, index)
        wanted = {c: record_key(settings.model, uid, c) for c in conds}
        keys.update(wanted.values())
        pending = [c for c, k in wanted.items() if k not in done]
        if pending:
            todo.append(((task, length, index), pending))
    skipped = len(keys) - sum(len(p) for _, p in todo)
    pairs = [(generate(ctx, *item), c)
             for item, pending in tqdm(todo, desc="generate", unit="sample", leave=False)
             for c in pending]
    client = client or (make_client(settings) if pairs else None)
    writer = JsonlAppender(out)
    errors = 0
    try:
        with ThreadPoolExecutor(max_workers=max(1, settings.concurrency)) as pool, \
                tqdm(total=len(pairs), desc="eval", unit="sample") as bar:
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
