"""Soak: hours of mixed traffic through ``vllm-kvcomp serve`` on a pool that is too small.

One ``vllm-kvcomp serve`` (bundled model, or ``--model``) on 127.0.0.1 with prefix caching on
and a memory-bound KV pool (``--pool-blocks``, block size 32: about two full-cache 2K requests).
``--clients`` clients send requests back to back for ``--duration`` seconds of load; every
``--wave-every`` seconds ``--wave-clients`` more join for ``--wave-seconds`` (so vLLM preempts);
every ``--idle-every`` seconds all clients pause until their requests are answered and the server
reports no running and no waiting request, and the KV usage is read (it must be 0). These
pauses do not count as load: the duration, waves and idle points run on a clock that stops
during them (a wave client's last request may end after its wave). Each request draws at
random (seeded):

- the policy: every registered policy the served model can use (razor and pod need a calibration
  profile), or ``none`` (no header at all); ``ratio`` from ``--ratios`` where the policy takes one;
  compression during prefill for half the requests of a compressing policy (``prefill=stream``
  where the policy streams, else ``prefill=block``); the spec in the
  ``X-KV-Compression`` header, or (20 %) as the ``kv_compression`` body field;
- the prompt length (log-uniform in ``--min-prompt``..``--max-prompt`` tokens) and output length
  (log-uniform in ``--min-output``..``--max-output``, ``ignore_eos``);
- chat or completions, streamed or not (streams ask for the usage chunk half of the time);
- ``--abort-share`` of the requests are streams closed by the client after a random number of
  tokens (0: right after the response headers, while the prompt is queued or in prefill);
- ``--malformed-share`` are malformed (bad headers and bodies, a header on ``/tokenize``, a prompt
  over the model length): each must get HTTP 400.

Prompts are unique random token ids (completions) or random words (chat), except
``--repeat-share`` of the completions, which start with one of four shared documents, and the
request drawn right after each of them, which repeats the same document (it reaches the server
while the first is in flight or just done, before the small pool evicts the blocks): the prefix
cache is hit, shared by running requests, and copy-on-compress runs. Every ``--sample-every`` seconds it records the
RSS of the API server, the engine core and its workers, vLLM's KV usage, running / waiting /
preemption counts and the ``vllm:kvcomp_*`` gauges; per request the status, TTFT, inter-token
gaps and usage. ``--baseline`` then runs the same soak with full cache only (``none`` and
``policy=full``) on a fresh server, so the report can say what RSS noise is; ``--plain`` runs the
same load without any compression setting on vLLM's own server without the plugin (only the
malformed requests vLLM refuses itself), so it can say what vLLM's own memory does. Every server
gets the same cores (:data:`SERVER_ENV`). ``--trim-at-idle``
makes every server process give its free heap back at each idle point (glibc ``malloc_trim``
through gdb) and records RSS again: glibc keeps freed memory of varying-size tensors mapped
(its high-water mark rises in steps), so only the trimmed readings tell a leak from retention. The report goes to
``--out``; the raw records to ``<out>_<run>.jsonl`` and one plot to ``<out>_timeline.png``.

::

    vllm-kvcomp bench soak --plain --trim-at-idle --duration 3600 --idle-every 900   # 2 x 1 hour
    vllm-kvcomp bench soak --baseline --trim-at-idle --out docs/results/soak.md   # 2 x 20 minutes
    vllm-kvcomp bench soak --policies none --duration 600               # full cache only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import string
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvcomp.bench.common import module_main, write_report
from vllm_kvcomp.bench.serving import HEADER, feasible_ratios, gauges, served
from vllm_kvcomp.policies.registry import (
    NO_COMPRESSION_WORDS,
    POLICY_NAMES,
    get_policy_class,
    streaming_policy_names,
)

MODEL_NAME = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 32  # what bench.serving.served runs
APPLIED = "X-KV-Compression-Applied"
NO_HEADER = "none"  # the label of requests that carry no compression setting at all
BASELINE_LABELS = NO_COMPRESSION_WORDS  # full cache only: no header, and ``policy=full``
CHAT_MARGIN = 64  # tokens the chat template adds around a message, at most
FIRST_TOKEN_ID = 32  # random prompt ids start here (special tokens sit below)
SHARED_DOCS = 4
ERROR_CHARS = 300
PROGRESS_S = 30.0
SETTLE_READS = 5  # idle point: reads of /metrics (1 s apart) until the KV gauges show 0

USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
SAVED, HELD, UNCOMPRESSED = "vllm:kvcomp_saved_blocks", "vllm:kvcomp_held_blocks", "vllm:kvcomp_uncompressed_blocks"
COMPRESSED_TOTAL = "vllm:kvcomp_requests_compressed_total"
FREED_TOTAL = "vllm:kvcomp_blocks_freed_total"
RESERVED = "vllm:kvcomp_reserved_bytes"
METRICS = (USAGE, RUNNING, WAITING, PREEMPTIONS, PREFIX_HITS, PREFIX_QUERIES, SAVED, HELD, UNCOMPRESSED,
           COMPRESSED_TOTAL, FREED_TOTAL, RESERVED)
#: every server of a soak gets the same cores: vLLM's CPU backend otherwise reserves one more
#: core for the engine when a KV connector (the plugin) is set
SERVER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
PLAIN = "plain"  # the run on vLLM's own server, without the plugin
#: process name prefix (vLLM sets the titles) -> role in the RSS samples
ROLES = {"VLLM::EngineCore": "engine", "VLLM::Worker": "worker"}


# ---------------------------------------------------------------------------- what a request is


@dataclass(frozen=True)
class Malformed:
    """A request that must be refused with HTTP 400: what to send instead of a normal one."""

    kind: str
    path: str = "/v1/completions"
    header: str | None = None
    body: dict[str, Any] = field(default_factory=dict)  # merged into a small completions body
    raw: str | None = None  # sent as the body instead of JSON
    prompt_tokens: int = 16
    native: bool = False  # vLLM refuses it itself (a server without the plugin answers 400 too)


@dataclass(frozen=True)
class Draw:
    """One request as drawn: what it asks for and how the client behaves."""

    index: int
    label: str  # "none" (no setting sent), a registered policy name, or "malformed"
    ratio: float | None = None
    prefill: str | None = None  # "stream" or "block": compressed after every prefill chunk
    in_body: bool = False  # the spec goes in the ``kv_compression`` body field, not the header
    route: str = "completions"  # or "chat"
    stream: bool = False
    include_usage: bool = False
    prompt_tokens: int = 0
    max_tokens: int = 0
    abort_after: int | None = None  # close the connection after this many content chunks
    shared_doc: int | None = None  # the prompt starts with this shared document
    malformed: Malformed | None = None

    @property
    def compressed(self) -> bool:
        """Whether the request asks for a compressing policy."""
        return self.malformed is None and self.label not in NO_COMPRESSION_WORDS

    def settings(self) -> dict[str, Any]:
        """The spec the request sends (empty for ``none``)."""
        if self.label == NO_HEADER or self.malformed:
            return {}
        out: dict[str, Any] = {"policy": self.label}
        if self.ratio is not None:
            out["ratio"] = self.ratio
        if self.prefill is not None:
            out["prefill"] = self.prefill
        return out

    def header(self) -> str | None:
        """The ``X-KV-Compression`` value, when the spec goes in the header."""
        settings = self.settings()
        if not settings or self.in_body:
            return None
        return "; ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                         for key, value in settings.items())


@dataclass(frozen=True)
class Shares:
    """How often each random choice comes out one way (the rest: the other way)."""

    abort: float = 0.10
    malformed: float = 0.02
    repeat: float = 0.10  # completions that start with a shared document (the next request repeats it)
    stream: float = 0.5
    chat: float = 0.5
    prefill_chunks: float = 0.5  # of a compressing policy's requests: prefill=stream or block
    in_body: float = 0.2
    include_usage: float = 0.5  # of the streams


def malformed_cases(policies: Sequence[str], max_len: int) -> list[Malformed]:
    """Every malformed request the soak sends, from the registry: per compressing policy a ratio
    out of range, a pair without a value, a key given twice, an unknown key (and ``prefill=stream``
    on a policy that cannot stream), plus route, body and vLLM-side errors."""
    streaming = set(streaming_policy_names())
    unknown = "zip"
    while unknown in POLICY_NAMES:
        unknown += "x"
    cases = [Malformed("unknown policy", header=f"policy={unknown}"),
             Malformed("ratio without a policy", header="ratio=0.5"),
             Malformed("body not JSON", raw="{not json", native=True),
             Malformed("max_tokens negative", body={"max_tokens": -1}, native=True),
             Malformed("prompt over the model length", prompt_tokens=max_len + 1, native=True)]
    for name in policies:
        if name in NO_COMPRESSION_WORDS:
            continue
        params = get_policy_class(name).accepted_params()
        cases += [Malformed("pair without a value", header=f"{name}; ratio"),
                  Malformed("unknown key", header=f"policy={name}; nosuchkey=1"),
                  Malformed("kv_compression not an object", body={"kv_compression": name}),
                  Malformed("header on /tokenize", path="/tokenize", header=f"policy={name}")]
        if "ratio" in params:
            cases += [Malformed("ratio above 1", header=f"policy={name}; ratio=1.5"),
                      Malformed("key twice", header=f"policy={name}; ratio=0.5; ratio=0.4")]
        if name not in streaming:
            cases.append(Malformed("prefill=stream on a scoring policy", header=f"policy={name}; prefill=stream"))
    return cases


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high], uniform in log scale (short requests are common, long ones rare)."""
    return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))))))


class Drawer:
    """Draws requests at random from one seeded generator (the same seed, the same sequence)."""

    def __init__(self, seed: int, labels: Sequence[str], ratios: Sequence[float], prompt: tuple[int, int],
                 output: tuple[int, int], max_len: int, shares: Shares | None = None,
                 label_ratios: Mapping[str, Sequence[float]] | None = None, native_only: bool = False):
        """``label_ratios``: a policy's own ratios where the server refuses some of ``ratios`` (razor's
        profile), else ``ratios``; ``native_only``: only the malformed requests vLLM itself refuses
        (for a server without the plugin)."""
        if not labels:
            raise ValueError("no policy to draw from")
        self.rng = random.Random(seed)
        self.labels, self.ratios, self.prompt, self.output = list(labels), list(ratios), prompt, output
        self.label_ratios = {label: list(values) for label, values in (label_ratios or {}).items()}
        self.shares = shares or Shares()
        self.streaming = set(streaming_policy_names())
        kinds: dict[str, list[Malformed]] = {}
        for case in malformed_cases(POLICY_NAMES, max_len):
            if case.native or not native_only:
                kinds.setdefault(case.kind, []).append(case)
        self.malformed = kinds
        # shared documents: at most half the longest prompt, so a unique tail always fits after one
        self.doc_tokens = [log_uniform(self.rng, prompt[0], max(prompt[0], prompt[1] // 2)) for _ in range(SHARED_DOCS)]
        self.count = 0
        self.follow: int | None = None  # the shared document the next request repeats

    def draw(self) -> Draw:
        """The next request."""
        rng, shares = self.rng, self.shares
        index, self.count = self.count, self.count + 1
        if rng.random() < shares.malformed:
            kind = rng.choice(sorted(self.malformed))
            return Draw(index, "malformed", malformed=rng.choice(self.malformed[kind]))
        label = rng.choice(self.labels)
        params = {} if label == NO_HEADER else get_policy_class(label).accepted_params()
        ratio = rng.choice(self.label_ratios.get(label, self.ratios)) if "ratio" in params else None
        chunks = label not in NO_COMPRESSION_WORDS and rng.random() < shares.prefill_chunks
        prefill = ("stream" if label in self.streaming else "block") if chunks else None
        in_body = label != NO_HEADER and rng.random() < shares.in_body
        route = "completions" if self.follow is not None or rng.random() >= shares.chat else "chat"
        abort = rng.random() < shares.abort
        stream = abort or rng.random() < shares.stream
        include_usage = stream and rng.random() < shares.include_usage
        max_tokens = log_uniform(rng, *self.output)
        shared_doc, self.follow = self.follow, None
        if shared_doc is None and route == "completions" and rng.random() < shares.repeat:
            shared_doc = self.follow = rng.randrange(SHARED_DOCS)  # and the next request repeats it
        if shared_doc is not None:
            doc = self.doc_tokens[shared_doc]
            prompt_tokens = doc + rng.randint(1, max(1, min(512, self.prompt[1] - doc)))
        else:
            prompt_tokens = log_uniform(rng, *self.prompt)
        abort_after = rng.randint(0, max(1, max_tokens // 2)) if abort else None
        return Draw(index, label, ratio, prefill, in_body, route, stream, include_usage, prompt_tokens,
                    max_tokens, abort_after, shared_doc)


# ---------------------------------------------------------------------------- request bodies


class Prompts:
    """Prompt content of a draw: random token ids (completions) or random words (chat)."""

    def __init__(self, seed: int, vocab: int, counter: Any, docs: Sequence[int]):
        self.seed, self.vocab, self.counter = seed, vocab, counter
        self.docs = [self.ids(f"{seed}/doc/{i}", n) for i, n in enumerate(docs)]

    def ids(self, key: str, count: int) -> list[int]:
        """``count`` random token ids, a function of ``key``."""
        rng = random.Random(key)
        return [rng.randrange(FIRST_TOKEN_ID, self.vocab) for _ in range(count)]

    def completion_prompt(self, draw: Draw) -> list[int]:
        """Unique random ids, or a shared document followed by a unique tail."""
        key = f"{self.seed}/request/{draw.index}"
        if draw.shared_doc is None:
            return self.ids(key, draw.prompt_tokens)
        doc = self.docs[draw.shared_doc]
        return doc + self.ids(key, draw.prompt_tokens - len(doc))

    def chat_text(self, draw: Draw) -> str:
        """Random lower-case words measuring about ``draw.prompt_tokens`` tokens (fitted in rounds)."""
        rng = random.Random(f"{self.seed}/chat/{draw.index}")
        words: list[str] = []
        target, count = draw.prompt_tokens, max(1, draw.prompt_tokens // 2)
        for _ in range(4):
            while len(words) < count:
                words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))))
            del words[count:]
            measured = self.counter.count(" ".join(words))
            if abs(measured - target) <= max(4, target // 100):
                break
            count = max(1, round(count * target / max(1, measured)))
        while measured > target and len(words) > 1:  # never over: the model length allows the target only
            del words[-max(1, (measured - target) // 3):]
            measured = self.counter.count(" ".join(words))
        return " ".join(words)


def request_parts(draw: Draw, model: str, prompts: Prompts) -> tuple[str, dict[str, str], dict[str, Any] | None,
                                                                       str | None]:
    """(path, headers, JSON body, raw body) of a draw."""
    if draw.malformed is not None:
        bad = draw.malformed
        body = {"model": model, "prompt": prompts.ids(f"{prompts.seed}/bad/{draw.index}", bad.prompt_tokens),
                "max_tokens": 4, **bad.body}
        headers = {HEADER: bad.header} if bad.header else {}
        if bad.raw is not None:
            return bad.path, {**headers, "Content-Type": "application/json"}, None, bad.raw
        return bad.path, headers, body, None
    body = {"model": model, "max_tokens": draw.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": draw.stream}
    if draw.include_usage:
        body["stream_options"] = {"include_usage": True}
    if draw.route == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompts.chat_text(draw)}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompts.completion_prompt(draw)
    header = draw.header()
    if draw.in_body and draw.settings():
        body["kv_compression"] = draw.settings()
    return path, ({HEADER: header} if header else {}), body, None


# ---------------------------------------------------------------------------- one request


@dataclass
class Result:
    """What one request got back."""

    draw: Draw
    wave: bool
    sent: float  # seconds since the start of the soak
    latency: float | None = None
    status: int | None = None  # HTTP status; None: no response
    outcome: str = ""  # ok | aborted (by the client, on purpose) | rejected (malformed, got 400) | error
    error: str = ""
    stream_error: int | None = None  # ``code`` of an error event inside a 200 stream
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0  # content chunks received
    usage: dict[str, Any] = field(default_factory=dict)  # prompt_tokens, completion_tokens
    kvc: dict[str, Any] = field(default_factory=dict)  # usage.kv_compression
    applied: str | None = None
    aborted: bool = False

    @property
    def server_error(self) -> bool:
        """An HTTP 5xx, or an error event with a 5xx code inside a stream."""
        return (self.status or 0) >= 500 or (self.stream_error or 0) >= 500


def check_answer(draw: Draw, result: Result, plugin: bool = True) -> str:
    """What is wrong with a complete 200 answer ('' when nothing): the applied spec, the usage
    extension and the output length must be the ones asked for (``plugin`` False: a server
    without the plugin, which must send neither)."""
    expected = draw.label if draw.compressed else "full"
    completion = result.usage.get("completion_tokens")
    if completion is not None and completion != draw.max_tokens:
        return f"completion_tokens {completion} for max_tokens {draw.max_tokens} with ignore_eos"
    if not plugin:
        return f"{APPLIED} {result.applied!r} from a server without the plugin" if result.applied or result.kvc else ""
    if result.applied is None:
        return f"no {APPLIED} header"
    if (result.applied == "none") != (expected == "full") or (
            expected != "full" and not result.applied.startswith(f"policy={expected}")):
        return f"{APPLIED}: {result.applied!r} for a request of {expected}"
    if draw.prefill is not None and f"prefill={draw.prefill}" not in result.applied:
        return f"{APPLIED}: {result.applied!r} lost prefill={draw.prefill}"
    if not result.kvc:
        return "no kv_compression numbers in the response"
    if result.kvc.get("policy") != expected:
        return f"kv_compression.policy {result.kvc.get('policy')!r} for a request of {expected}"
    return ""


def classify(draw: Draw, result: Result, body_text: str, plugin: bool = True) -> None:
    """Set ``result.outcome`` (and its error text) once the exchange is over."""
    if draw.malformed is not None:
        result.outcome = "rejected" if result.status == 400 else "error"
        if result.outcome == "error":
            result.error = f"malformed ({draw.malformed.kind}): expected 400, got {result.status}: {body_text}"
    elif result.outcome == "error":
        return  # a transport error or timeout, already described
    elif result.status != 200:
        result.outcome, result.error = "error", f"HTTP {result.status}: {body_text}"
    elif result.stream_error is not None:
        result.outcome, result.error = "error", f"error event in the stream: {body_text}"
    elif result.aborted:
        result.outcome = "aborted"
    else:
        problem = check_answer(draw, result, plugin)
        result.outcome, result.error = ("error", f"check: {problem}") if problem else ("ok", "")


def _content(chunk: dict[str, Any], route: str) -> bool:
    choices = chunk.get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content") if route == "chat" else choices[0].get("text"))


async def _read_stream(response: Any, draw: Draw, result: Result, start: float) -> str:
    """Read SSE events into ``result``; close early for an abort; the error text if any."""
    if draw.abort_after == 0:
        result.aborted = True
        return ""
    last = start
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if isinstance(chunk.get("error"), dict):
            result.stream_error = int(chunk["error"].get("code") or 500)
            return line[:ERROR_CHARS]
        if _content(chunk, draw.route):
            now = time.monotonic()
            if result.ttft is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last, result.tokens = now, result.tokens + 1
            if draw.abort_after is not None and result.tokens >= draw.abort_after:
                result.aborted = True
                return ""
        if isinstance(chunk.get("usage"), dict):
            result.usage = {k: chunk["usage"].get(k) for k in ("prompt_tokens", "completion_tokens")}
            result.kvc = chunk["usage"].get("kv_compression") or result.kvc
        if isinstance(chunk.get("kv_compression"), dict):
            result.kvc = chunk["kv_compression"]
    return ""


async def send(client: Any, url: str, model: str, draw: Draw, prompts: Prompts, result: Result,
               plugin: bool = True) -> None:
    """Send one drawn request and fill ``result`` (``plugin`` False: the server runs without the
    plugin); never raises for what the server does."""
    import httpx

    path, headers, body, raw = request_parts(draw, model, prompts)
    start, text = time.monotonic(), ""
    try:
        async with client.stream("POST", url + path, headers=headers, json=body, content=raw) as response:
            result.status, result.applied = response.status_code, response.headers.get(APPLIED)
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:ERROR_CHARS]
            elif draw.stream:
                text = await _read_stream(response, draw, result, start)
            else:
                data = json.loads(await response.aread())
                usage = data.get("usage") or {}
                result.usage = {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens")}
                result.kvc = usage.get("kv_compression") or {}
    except httpx.HTTPError as err:
        result.outcome, result.error = "error", f"no answer: {type(err).__name__}: {str(err)[:ERROR_CHARS]}"
    except json.JSONDecodeError as err:
        result.outcome, result.error = "error", f"answer not JSON: {err}"
    result.latency = time.monotonic() - start
    classify(draw, result, text, plugin)


# ---------------------------------------------------------------------------- the server's processes


@dataclass
class Sample:
    """One reading every ``--sample-every`` seconds."""

    t: float
    rss: dict[str, float]  # role (api, engine, worker) -> MB, summed over the role's processes
    metrics: dict[str, float]
    engine_pids: tuple[int, ...]  # engine core and worker processes
    error: str = ""  # /metrics could not be read
    load: float = 0.0  # the machine's 1-minute load average (other work shares the cores)


class ServerProcesses:
    """The API server (our child process serving ``port``) and its engine core and workers."""

    def __init__(self, port: int):
        import psutil

        found = [p for p in psutil.Process().children() if str(port) in p.cmdline()]
        if len(found) != 1:
            raise RuntimeError(f"expected one server process on port {port}, found {len(found)}")
        self.api = found[0]

    def trim(self) -> None:
        """Every server process returns its free heap pages to the system (glibc ``malloc_trim(0)``
        called through gdb): RSS then counts what is live, not what the allocator keeps."""
        import subprocess

        import psutil

        try:
            pids = [self.api.pid, *(c.pid for c in self.api.children(recursive=True))]
        except psutil.Error:
            return
        for pid in pids:
            subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "call (int)malloc_trim(0)"],
                           capture_output=True, timeout=120, check=False)

    def snapshot(self) -> tuple[dict[str, float], tuple[int, ...]]:
        """RSS in MB per role, and the engine-side pids; empty when the API server is gone."""
        import psutil

        rss: dict[str, float] = {}
        pids: list[int] = []
        try:
            rss["api"] = self.api.memory_info().rss / 2**20
            for child in self.api.children(recursive=True):
                role = next((r for prefix, r in ROLES.items() if child.name().startswith(prefix)), None)
                if role is not None:
                    rss[role] = rss.get(role, 0.0) + child.memory_info().rss / 2**20
                    pids.append(child.pid)
        except psutil.Error:
            return {}, ()
        return rss, tuple(sorted(pids))


@dataclass
class IdlePoint:
    """The server with every client paused: what it holds once nothing runs or waits."""

    t: float
    waited: float  # seconds from pausing the clients to the reading
    reached: bool  # running and waiting both 0 within --idle-timeout of the last answer
    kv_usage: float  # vllm:kv_cache_usage_perc, a fraction of the pool
    held: float  # vllm:kvcomp_held_blocks
    saved: float  # vllm:kvcomp_saved_blocks
    prefix_hits: float  # vllm:prefix_cache_hits_total so far
    rss: dict[str, float]
    final: bool = False
    #: with --trim-at-idle: RSS per role after every server process gave its free heap back
    #: (glibc ``malloc_trim``): what the processes really hold, allocator retention left out
    rss_trimmed: dict[str, float] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        """Nothing held: KV usage and the kvcomp block gauges all 0."""
        return self.reached and self.kv_usage == 0 and self.held == 0 and self.saved == 0


# ---------------------------------------------------------------------------- the soak loop


@dataclass
class Soak:
    """Everything one run shares while it runs."""

    url: str
    model: str
    args: argparse.Namespace
    drawer: Drawer
    prompts: Prompts
    processes: ServerProcesses
    plugin: bool = True  # False: vLLM's own server, without the plugin
    t0: float = field(default_factory=time.monotonic)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    client: Any = None
    in_flight: int = 0
    results: list[Result] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    idles: list[IdlePoint] = field(default_factory=list)
    waves: list[tuple[float, float]] = field(default_factory=list)
    paused: float = 0.0  # seconds spent in idle points so far

    def now(self) -> float:
        """Seconds since the start."""
        return time.monotonic() - self.t0

    def load_time(self) -> float:
        """Seconds under load so far: since the start, less the idle-point pauses (the clock of
        ``--duration``, the waves and the idle points, so a slow drain does not eat the load)."""
        return self.now() - self.paused

    def stopping(self) -> bool:
        """No new requests: the duration is over or the request bound is reached."""
        return self.load_time() >= self.args.duration or self.drawer.count >= self.args.max_requests

    async def metrics(self) -> tuple[dict[str, float], str]:
        """The sampled series from /metrics (summed over labels), or {} and why not."""
        import httpx

        try:
            response = await self.client.get(f"{self.url}/metrics", timeout=30)
        except httpx.HTTPError as err:
            return {}, f"/metrics: {type(err).__name__}: {err}"
        if response.status_code != 200:
            return {}, f"/metrics: HTTP {response.status_code}"
        return gauges(response.text, METRICS), ""

    def drained(self, reading: dict[str, float]) -> bool:
        """No request in flight here, and the server reports none running or waiting."""
        return not self.in_flight and reading.get(RUNNING) == 0 and reading.get(WAITING) == 0


async def _client(soak: Soak, until: float, wave: bool) -> None:
    """Send requests back to back until ``until`` (seconds of load) or the soak stops."""
    while soak.load_time() < until and not soak.stopping():
        await soak.gate.wait()
        if soak.load_time() >= until or soak.stopping():
            return
        draw = soak.drawer.draw()
        result = Result(draw, wave, soak.now())
        soak.in_flight += 1
        try:
            await asyncio.wait_for(send(soak.client, soak.url, soak.model, draw, soak.prompts, result, soak.plugin),
                                   soak.args.request_timeout)
        except asyncio.TimeoutError:
            result.outcome = "error"
            result.error = f"no complete answer within --request-timeout {soak.args.request_timeout:g} s"
        finally:
            soak.in_flight -= 1
        soak.results.append(result)


async def _sampler(soak: Soak) -> None:
    """Record a :class:`Sample` every ``--sample-every`` seconds."""
    while True:
        rss, pids = soak.processes.snapshot()
        values, error = await soak.metrics()
        soak.samples.append(Sample(soak.now(), rss, values, pids, error, os.getloadavg()[0]))
        await asyncio.sleep(soak.args.sample_every)


async def _progress(soak: Soak, name: str) -> None:
    """A line every 30 s: elapsed time, requests by outcome, 5xx, server state, RSS."""
    while True:
        await asyncio.sleep(PROGRESS_S)
        outcomes = Counter(r.outcome for r in soak.results)
        last = soak.samples[-1] if soak.samples else Sample(0, {}, {}, ())
        rss = " ".join(f"{role} {mb:.0f}" for role, mb in sorted(last.rss.items()))
        print(f"[soak {name} {soak.now():6.0f} s] done {len(soak.results)} (ok {outcomes['ok']}, aborted "
              f"{outcomes['aborted']}, 400 {outcomes['rejected']}) errors {outcomes['error']} 5xx "
              f"{sum(r.server_error for r in soak.results)} | in flight {soak.in_flight}, running "
              f"{last.metrics.get(RUNNING, 0):.0f}, waiting {last.metrics.get(WAITING, 0):.0f}, KV "
              f"{last.metrics.get(USAGE, 0):.0%} | RSS MB {rss}", flush=True)


async def _idle_point(soak: Soak, final: bool = False) -> IdlePoint:
    """Pause the clients, let their requests end (each within --request-timeout), wait for the
    server to report running = waiting = 0 (within --idle-timeout), read the KV gauges, resume."""
    soak.gate.clear()
    start = time.monotonic()
    while soak.in_flight:
        await asyncio.sleep(0.5)
    deadline = time.monotonic() + soak.args.idle_timeout
    reading: dict[str, float] = {}
    while time.monotonic() < deadline:
        reading = (await soak.metrics())[0]
        if soak.drained(reading):
            break
        await asyncio.sleep(1)
    reached = soak.drained(reading)
    for _ in range(SETTLE_READS):  # the gauges arrive with engine steps: allow the last one to land
        if reached and reading.get(USAGE) == 0 and reading.get(HELD, 0) == 0 and reading.get(SAVED, 0) == 0:
            break
        await asyncio.sleep(1)
        reading = (await soak.metrics())[0]
    point = IdlePoint(soak.now(), time.monotonic() - start, reached, reading.get(USAGE, math.nan), reading.get(HELD, 0.0),
                      reading.get(SAVED, 0.0), reading.get(PREFIX_HITS, 0.0), soak.processes.snapshot()[0], final)
    if soak.args.trim_at_idle:
        await asyncio.to_thread(soak.processes.trim)
        point.rss_trimmed = soak.processes.snapshot()[0]
    print(f"[soak idle point {point.t:6.0f} s] after {point.waited:.0f} s: running/waiting 0: {reached}, KV usage "
          f"{point.kv_usage:.4f}, kvcomp held {point.held:.0f} saved {point.saved:.0f}", flush=True)
    soak.paused += point.waited
    soak.gate.set()
    return point


def schedule(duration: float, wave_every: float, wave_seconds: float, idle_every: float) -> list[tuple[float, str]]:
    """(seconds of load, "wave" | "idle") in time order: waves half a period off the
    period (``wave_every`` 150: at 75, 225, ...) that end before the duration does, idle points at
    least ``idle_every / 2`` before the end (the final one follows it)."""
    events = [((k - 0.5) * wave_every, "wave") for k in range(1, int(duration // wave_every) + 2)
              if (k - 0.5) * wave_every + wave_seconds <= duration] if wave_every > 0 else []
    events += [(k * idle_every, "idle") for k in range(1, int(duration // idle_every) + 1)
               if k * idle_every <= duration - idle_every / 2] if idle_every > 0 else []
    return sorted(events)


async def _soak(soak: Soak, name: str) -> None:
    """The whole run: steady clients, waves and idle points on schedule, drain, the final idle point."""
    import httpx

    args = soak.args
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        soak.client = client
        soak.gate.set()
        background = [asyncio.create_task(_sampler(soak)), asyncio.create_task(_progress(soak, name))]
        clients = [asyncio.create_task(_client(soak, args.duration, False)) for _ in range(args.clients)]
        try:
            for at, kind in schedule(args.duration, args.wave_every, args.wave_seconds, args.idle_every):
                await asyncio.sleep(max(0.0, at - soak.load_time()))
                if soak.stopping():
                    break
                if kind == "idle":
                    soak.idles.append(await _idle_point(soak))
                    continue
                until = min(args.duration, soak.load_time() + args.wave_seconds)
                soak.waves.append((soak.now(), soak.now() + until - soak.load_time()))
                clients += [asyncio.create_task(_client(soak, until, True)) for _ in range(args.wave_clients)]
            await asyncio.gather(*clients)
            soak.idles.append(await _idle_point(soak, final=True))
        finally:
            for task in [*background, *clients]:
                task.cancel()
            await asyncio.gather(*background, *clients, return_exceptions=True)


# ---------------------------------------------------------------------------- one run, start to end


@dataclass
class RunData:
    """One finished soak: the settings it ran with and everything it recorded."""

    name: str  # "mixed", "baseline" or "plain"
    command: str
    labels: list[str]
    left_out: list[str]  # registered policies the served model cannot use
    settings: dict[str, Any]
    results: list[Result]
    samples: list[Sample]
    idles: list[IdlePoint]
    waves: list[tuple[float, float]]
    elapsed: float
    server_alive: bool  # the API server was still running when the soak ended
    log_errors: list[str]  # ERROR / Traceback lines of the server log
    leftover: list[int]  # engine-side pids still alive after the server stopped (killed by the soak)
    plugin: bool = True  # False: vLLM's own server, without the plugin


def model_facts(model_dir: Path) -> tuple[int, int]:
    """(vocabulary size, max positions) from the model folder's config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    return int(config["vocab_size"]), int(config.get("max_position_embeddings") or 0)


def usable_policies(model_dir: Path) -> tuple[str, ...]:
    """Registered policies the server of this model accepts (razor / pod need a profile)."""
    from vllm_kvcomp.server.operator_config import OperatorConfig

    return OperatorConfig.for_server(None, str(model_dir)).usable_policies()


def policy_labels(wanted: str, usable: Sequence[str]) -> tuple[list[str], list[str]]:
    """(labels to draw from, registered policies left out because the model cannot use them);
    ``all`` is ``none`` plus every registered policy."""
    names = [NO_HEADER, *POLICY_NAMES] if wanted == "all" else [w.strip().lower() for w in wanted.split(",") if w.strip()]
    unknown = [n for n in names if n != NO_HEADER and n not in POLICY_NAMES]
    if unknown:
        raise SystemExit(f"--policies: unknown {unknown} (choose from all, {NO_HEADER}, {', '.join(POLICY_NAMES)})")
    left_out = [n for n in names if n != NO_HEADER and n not in usable]
    return [n for n in names if n not in left_out], left_out


def log_errors(log: Path, size: int) -> list[str]:
    """Lines in the first ``size`` bytes of the server log (what it wrote before it was told to
    stop; its shutdown logs errors of its own) that report an error: ``ERROR`` or a traceback."""
    with log.open("rb") as handle:
        text = handle.read(size).decode(errors="replace")
    return [line.strip()[:ERROR_CHARS] for line in text.splitlines()
            if " ERROR " in line or line.startswith("Traceback")]


def reap(pids: Sequence[int], wait: float = 30.0) -> list[int]:
    """Kill the engine-side processes still alive ``wait`` seconds after the server was stopped
    (the server's own shutdown should have ended them); the pids that needed it."""
    import psutil

    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            alive.append(psutil.Process(pid))
    _, left = psutil.wait_procs(alive, timeout=wait)
    for process in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return [process.pid for process in left]


def soak_run(args: argparse.Namespace, name: str, labels: list[str], left_out: list[str], model_dir: Path,
             plugin: bool = True) -> RunData:
    """Start a server (``plugin`` False: vLLM's own, without the plugin), soak it, stop it;
    everything recorded."""
    from vllm_kvcomp.eval.tasks.sizing import load_counter

    vocab, _ = model_facts(model_dir)
    ratios = [float(r) for r in args.ratios.split(",")]
    drawer = Drawer(args.seed, labels, ratios, (args.min_prompt, args.max_prompt),
                    (args.min_output, args.max_output), args.max_len,
                    Shares(abort=args.abort_share, malformed=args.malformed_share, repeat=args.repeat_share),
                    label_ratios=feasible_ratios(model_dir, labels, ratios), native_only=not plugin)
    prompts = Prompts(args.seed, vocab, load_counter(model_dir), drawer.doc_tokens)
    log = args.logs / f"soak_{name}.log"
    extra = ["--served-model-name", args.served_name, "--max-num-seqs", str(args.clients + args.wave_clients)]
    server = "vllm-kvcomp serve" if plugin else "vllm serve without the plugin"
    print(f"[soak {name}] policies {', '.join(labels)}; starting {server} (log: {log})", flush=True)
    with served(args.model, args.pool_blocks, args.clients + args.wave_clients, args.max_len, log, extra,
                prefix_caching=True, plain=not plugin, env=SERVER_ENV) as url:
        soak = Soak(url, args.served_name, args, drawer, prompts, ServerProcesses(int(url.rsplit(":", 1)[1])),
                    plugin)
        asyncio.run(_soak(soak, name))
        alive, log_size = soak.processes.api.is_running(), log.stat().st_size
        engine_pids = soak.processes.snapshot()[1]
    settings = {key: getattr(args, key) for key in SETTINGS} | {"label_ratios": drawer.label_ratios}
    return RunData(name, args.command, labels, left_out, settings, soak.results, soak.samples, soak.idles, soak.waves,
                   soak.now(), alive, log_errors(log, log_size), reap(engine_pids), plugin)


SETTINGS = ("trim_at_idle", "quarter", "duration", "clients", "wave_clients", "wave_every", "wave_seconds", "idle_every", "pool_blocks",
            "max_len", "min_prompt", "max_prompt", "min_output", "max_output", "ratios", "abort_share",
            "malformed_share", "repeat_share", "warmup", "window", "seed")


# ---------------------------------------------------------------------------- figures


def fit_slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (NaN with fewer than two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return float("nan")
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def rss_slopes(samples: Sequence[Sample], warmup: float) -> dict[str, float]:
    """RSS slope in MB/hour after ``warmup`` seconds, per role and in total."""
    kept = [s for s in samples if s.t >= warmup and s.rss]
    roles = sorted({role for s in kept for role in s.rss})
    out = {role: fit_slope([(s.t, s.rss[role]) for s in kept if role in s.rss]) * 3600 for role in roles}
    out["total"] = fit_slope([(s.t, sum(s.rss.values())) for s in kept]) * 3600
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear between order statistics); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_stats(results: Sequence[Result]) -> dict[str, float]:
    """n, p50/p99 TTFT and p50/p99 inter-token gap of the completed streams among ``results``."""
    streams = [r for r in results if r.outcome == "ok" and r.ttft is not None]
    ttft = [r.ttft for r in streams if r.ttft is not None]
    itl = [gap for r in streams for gap in r.itl]
    return {"n": len(streams), "ttft50": percentile(ttft, 50), "ttft99": percentile(ttft, 99),
            "itl50": percentile(itl, 50), "itl99": percentile(itl, 99)}


def windows(results: Sequence[Result], window: float, end: float) -> list[tuple[float, dict, dict]]:
    """Per ``window`` seconds (by send time): latency stats of uncompressed and of compressed requests."""
    out = []
    for k in range(max(1, math.ceil(end / window))):
        inside = [r for r in results if k * window <= r.sent < (k + 1) * window]
        out.append((k * window, latency_stats([r for r in inside if not r.draw.compressed]),
                    latency_stats([r for r in inside if r.draw.compressed])))
    return out


def restarted(run: RunData) -> bool:
    """Whether the engine-side processes ever changed (or vanished) during the run."""
    pids = {s.engine_pids for s in run.samples}
    return len(pids) != 1 or () in pids or not run.server_alive


def preemptions(run: RunData) -> float:
    """vLLM's preemption counter over the run."""
    counts = [s.metrics[PREEMPTIONS] for s in run.samples if PREEMPTIONS in s.metrics]
    return counts[-1] - counts[0] if counts else float("nan")


# ---------------------------------------------------------------------------- report


def _f(value: float, digits: int = 2, sign: bool = False) -> str:
    if value != value:  # NaN
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _load(samples: Sequence[Sample]) -> str:
    loads = [s.load for s in samples]
    return f"{statistics.median(loads):.1f} / {max(loads):.1f}" if loads else "-"


def summary_rows(run: RunData) -> dict[str, str]:
    """The run's key figures, one table cell each."""
    outcomes = Counter(r.outcome for r in run.results)
    slopes = rss_slopes(run.samples, run.settings["warmup"])
    first = next((s.rss for s in run.samples if s.rss), {})
    last = next((s.rss for s in reversed(run.samples) if s.rss), {})
    unc = latency_stats([r for r in run.results if not r.draw.compressed])
    comp = latency_stats([r for r in run.results if r.draw.compressed])
    last_sample = run.samples[-1].metrics if run.samples else {}
    return {
        "soak length (s): all / under load (idle-point pauses excluded)":
            f"{run.elapsed:.0f} / {run.elapsed - sum(p.waited for p in run.idles):.0f}",
        "requests sent": str(len(run.results)),
        "ok / aborted by the client / malformed → 400": f"{outcomes['ok']} / {outcomes['aborted']} / {outcomes['rejected']}",
        "errors (any other answer)": str(outcomes["error"]),
        "**5xx** (must be 0)": f"**{sum(r.server_error for r in run.results)}**",
        "no answer (transport / timeout)": str(sum(r.status is None for r in run.results)),
        "idle points with KV usage 0 and kvcomp held/saved 0": f"{sum(p.clean for p in run.idles)} of {len(run.idles)}",
        "KV usage at the idle points": ", ".join(f"{p.kv_usage:g}" for p in run.idles) or "-",
        "RSS start → end, MB (api + engine + worker)": f"{sum(first.values()):.0f} → {sum(last.values()):.0f}",
        **{f"RSS slope after warm-up, {role} (MB/h)": _f(v, 1, sign=True) for role, v in slopes.items()},
        **trimmed_rows(run),
        "plugin memory bound (vllm:kvcomp_reserved_bytes), MiB": _f(last_sample.get(RESERVED, math.nan) / 2**20, 0),
        "preemptions (vllm:num_preemptions_total)": _f(preemptions(run), 0),
        "prefix-cache hits / queries (tokens)": f"{last_sample.get(PREFIX_HITS, 0):.0f} / {last_sample.get(PREFIX_QUERIES, 0):.0f}",
        "engine restarted (engine core / worker pids changed)": "yes" if restarted(run) else "no",
        "machine load average (1 min), median / max": _load(run.samples),
        "server log ERROR / Traceback lines (before the stop)": str(len(run.log_errors)),
        "engine processes left after the stop": ", ".join(map(str, run.leftover)) or "none",
        "TTFT p50 / p99 (s), uncompressed streams": f"{_f(unc['ttft50'])} / {_f(unc['ttft99'])} (n={unc['n']})",
        "TTFT p50 / p99 (s), compressed streams": f"{_f(comp['ttft50'])} / {_f(comp['ttft99'])} (n={comp['n']})",
        "ITL p50 / p99 (ms), uncompressed": f"{_f(unc['itl50'] * 1e3, 0)} / {_f(unc['itl99'] * 1e3, 0)}",
        "ITL p50 / p99 (ms), compressed": f"{_f(comp['itl50'] * 1e3, 0)} / {_f(comp['itl99'] * 1e3, 0)}",
    }


def trimmed_rows(run: RunData) -> dict[str, str]:
    """With --trim-at-idle: the worker's and the total RSS at the idle points after the heap was
    given back, and their slope over the idle points after warm-up (a leak grows; retention does not)."""
    points = [p for p in run.idles if p.rss_trimmed]
    if not points:
        return {}
    after = [p for p in points if p.t >= run.settings["warmup"]]
    worker = [(p.t, p.rss_trimmed.get("worker", math.nan)) for p in after]
    total = [(p.t, sum(p.rss_trimmed.values())) for p in after]
    return {
        "worker RSS at the idle points, MB: as sampled → after malloc_trim":
            ", ".join(f"{p.rss.get('worker', math.nan):.0f} → {p.rss_trimmed.get('worker', math.nan):.0f}" for p in points),
        "slope of the trimmed idle-point RSS after warm-up, worker / total (MB/h)":
            f"{_f(fit_slope(worker) * 3600, 1, sign=True)} / {_f(fit_slope(total) * 3600, 1, sign=True)}",
    }


def quarters(run: RunData, quarter: float) -> list[dict[str, float]]:
    """Per ``quarter`` seconds of the run (wall time): the worker's RSS at its end, the slope of
    the worker's RSS within it (MB/h), the worker's RSS after ``malloc_trim`` at its last idle point
    (NaN: none) and the requests sent in it."""
    end = max((sample.t for sample in run.samples), default=0.0)
    out = []
    for k in range(max(1, math.ceil(end / quarter))):
        low, high = k * quarter, (k + 1) * quarter
        inside = [sample for sample in run.samples if low <= sample.t < high and "worker" in sample.rss]
        trimmed = [p for p in run.idles if low <= p.t < high and "worker" in p.rss_trimmed]
        out.append({"start": low, "end": min(high, end),
                    "worker": inside[-1].rss["worker"] if inside else math.nan,
                    "slope": fit_slope([(sample.t, sample.rss["worker"]) for sample in inside]) * 3600,
                    "trimmed": trimmed[-1].rss_trimmed["worker"] if trimmed else math.nan,
                    "sent": sum(low <= r.sent < high for r in run.results)})
    return out


def quarter_table(runs: Sequence[RunData], quarter: float) -> list[str]:
    """The worker's RSS quarter by quarter, the runs side by side: a levelling-off shows as the
    slope falling toward 0."""
    per_run = [quarters(run, quarter) for run in runs]
    head = "| quarter (s) | " + " | ".join(
        f"{run.name}: worker RSS at its end, MB | slope within, MB/h | after malloc_trim at its idle point, MB | "
        f"requests sent" for run in runs) + " |"
    lines = [head, "|---|" + "---|" * 4 * len(runs)]
    for k in range(max(len(rows) for rows in per_run)):
        cells = [f"{k * quarter:.0f}–{(k + 1) * quarter:.0f}"]
        for rows in per_run:
            row = rows[k] if k < len(rows) else None
            cells += ["-"] * 4 if row is None else [
                _f(row["worker"], 0), _f(row["slope"], 0, sign=True), _f(row["trimmed"], 0), str(row["sent"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def against_plain(runs: Sequence[RunData]) -> list[str]:
    """Each run with the plugin against the run without it: the worker's RSS slope after warm-up
    (as sampled, and after ``malloc_trim`` at the idle points) as a ratio, and how much more RSS
    the worker holds after the trim at each idle point (to set against the plugin's bound)."""
    plain = next((run for run in runs if not run.plugin), None)
    if plain is None:
        return []
    warmup = plain.settings["warmup"]

    def trimmed(run: RunData) -> list[IdlePoint]:
        return [p for p in run.idles if "worker" in p.rss_trimmed]

    def trimmed_slope(run: RunData) -> float:
        return fit_slope([(p.t, p.rss_trimmed["worker"]) for p in trimmed(run) if p.t >= warmup]) * 3600

    base, base_trim = rss_slopes(plain.samples, warmup).get("worker", math.nan), trimmed_slope(plain)
    lines = []
    for run in runs:
        if run is plain:
            continue
        slope, trim = rss_slopes(run.samples, warmup).get("worker", math.nan), trimmed_slope(run)
        above = [a.rss_trimmed["worker"] - b.rss_trimmed["worker"] for a, b in zip(trimmed(run), trimmed(plain))]
        lines += [f"- **{run.name} against {plain.name}**: worker RSS slope after warm-up {_f(slope, 1, sign=True)} vs "
                  f"{_f(base, 1, sign=True)} MB/h = **{_f(slope / base if base else math.nan, 2)}x** as sampled; "
                  f"after malloc_trim at the idle points {_f(trim, 1, sign=True)} vs {_f(base_trim, 1, sign=True)} MB/h"
                  + (f"; the worker holds {', '.join(_f(a, 0, sign=True) for a in above)} MB more than "
                     f"{plain.name}'s after the trim, idle point by idle point" if above else "")]
    return lines


def policy_table(run: RunData) -> list[str]:
    """Requests done per policy: outcomes, kinds, and the usage extension's numbers."""
    lines = ["| policy | sent | ok | aborted | errors | 5xx | streamed | chat | prefill=stream / block | in body | "
             "mean kept_fraction | blocks freed | preemptions (usage) |", "|---|" + "---|" * 12]
    for label in run.labels:
        mine = [r for r in run.results if r.draw.label == label]
        ok = [r for r in mine if r.outcome == "ok"]
        kept = [r.kvc["kept_fraction"] for r in ok if "kept_fraction" in r.kvc]
        lines.append(
            f"| {label} | {len(mine)} | {len(ok)} | {sum(r.outcome == 'aborted' for r in mine)} | "
            f"{sum(r.outcome == 'error' for r in mine)} | {sum(r.server_error for r in mine)} | "
            f"{sum(r.draw.stream for r in mine)} | {sum(r.draw.route == 'chat' for r in mine)} | "
            f"{sum(r.draw.prefill is not None for r in mine)} | {sum(r.draw.in_body for r in mine)} | "
            f"{_f(statistics.fmean(kept), 3) if kept else '-'} | {sum(r.kvc.get('blocks_freed', 0) for r in ok)} | "
            f"{sum(r.kvc.get('preemptions', 0) for r in ok)} |")
    return lines


def malformed_table(run: RunData) -> list[str]:
    """Malformed requests per kind and the statuses they got."""
    kinds: dict[str, Counter] = {}
    for r in run.results:
        if r.draw.malformed is not None:
            kinds.setdefault(r.draw.malformed.kind, Counter())[r.status] += 1
    lines = ["| malformed request | sent | statuses |", "|---|---|---|"]
    lines += [f"| {kind} | {sum(c.values())} | {', '.join(f'{s}: {n}' for s, n in sorted(c.items(), key=str))} |"
              for kind, c in sorted(kinds.items())]
    return lines


def window_table(run: RunData, window: float) -> list[str]:
    """p50 / p99 TTFT and ITL per time window, uncompressed vs compressed."""
    lines = ["| sent in (s) | uncompressed n | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | compressed n | "
             "TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |", "|---|---|---|---|---|---|---|"]
    for start, unc, comp in windows(run.results, window, run.settings["duration"]):
        cells = [f"{start:.0f}–{start + window:.0f}"]
        for stats in (unc, comp):
            cells += [str(stats["n"]), f"{_f(stats['ttft50'])} / {_f(stats['ttft99'])}",
                      f"{_f(stats['itl50'] * 1e3, 0)} / {_f(stats['itl99'] * 1e3, 0)}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def idle_table(run: RunData) -> list[str]:
    """Every idle point: when, how long the drain took, what was still held."""
    lines = ["| at (s) | drained in (s) | running = waiting = 0 | KV usage | kvcomp held / saved blocks | "
             "prefix-cache hits so far | RSS MB (api / engine / worker) |", "|---|---|---|---|---|---|---|"]
    for p in run.idles:
        rss = " / ".join(f"{p.rss.get(role, float('nan')):.0f}" for role in ("api", "engine", "worker"))
        lines.append(f"| {p.t:.0f}{' (end)' if p.final else ''} | {p.waited:.0f} | {'yes' if p.reached else '**no**'} | "
                     f"{p.kv_usage:g} | {p.held:.0f} / {p.saved:.0f} | {p.prefix_hits:.0f} | {rss} |")
    return lines


def error_lines(run: RunData) -> list[str]:
    """Distinct error texts (digits folded) with their counts, and the server log's error lines."""
    import re

    texts = Counter(re.sub(r"\d+", "N", r.error) for r in run.results if r.outcome == "error")
    lines = [f"- {n} × `{text}`" for text, n in texts.most_common()] or ["- none"]
    logged = Counter(re.sub(r"\d+", "N", line) for line in run.log_errors)
    lines += ["", "Server log:"] + ([f"- {n} × `{text}`" for text, n in logged.most_common(10)] or ["- no ERROR lines"])
    return lines


def _own_ratios(label_ratios: Mapping[str, Sequence[float]] | None) -> str:
    """`` (razor: 0.5, the only ones it accepts on this model)`` or nothing."""
    if not label_ratios:
        return ""
    own = "; ".join(f"{label}: {','.join(f'{r:g}' for r in values)}" for label, values in label_ratios.items())
    return f" ({own}: the only ones the server accepts for it on this model)"


def render(runs: Sequence[RunData], plot: Path | None) -> str:
    """The markdown report: key figures side by side, then each run's tables."""
    first = runs[0]
    s = first.settings
    rows = [summary_rows(run) for run in runs]
    servers = "`vllm-kvcomp serve`" + ("; the plain run through vLLM's own `vllm serve` without the plugin (its entry "
                                       "point left out through `VLLM_PLUGINS`, the same flags and CPU defaults)"
                                       if any(not run.plugin for run in runs) else "")
    cores = ", ".join(f"{k}={v}" for k, v in SERVER_ENV.items())
    lines = [f"Through {servers}; every server with {cores} (the same cores), on 127.0.0.1, prefix caching on, "
             f"block size {BLOCK_SIZE}, a pool of "
             f"{s['pool_blocks']} blocks (max model length {s['max_len']}); {s['clients']} clients for "
             f"{s['duration']:g} s of load, waves of {s['wave_clients']} more for {s['wave_seconds']:g} s every "
             f"{s['wave_every']:g} s, idle points every {s['idle_every']:g} s of load; prompts "
             f"{s['min_prompt']}–{s['max_prompt']} tokens, outputs {s['min_output']}–{s['max_output']}, ratios "
             f"{s['ratios']}{_own_ratios(s.get('label_ratios'))}; {s['abort_share']:.0%} aborted by the client, {s['malformed_share']:.0%} malformed, "
             f"{s['repeat_share']:.0%} of completions start with a shared document; seed {s['seed']}. "
             f"RSS slopes fit the samples after {s['warmup']:g} s.", ""]
    lines += [f"- {run.name}: policies {', '.join(run.labels)}" + (
        f" (left out, no calibration profile for the model: {', '.join(run.left_out)})" if run.left_out else "")
        for run in runs]
    lines += ["", "| | " + " | ".join(run.name for run in runs) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {key} | " + " | ".join(row.get(key, "-") for row in rows) + " |" for key in rows[0]]
    compared = against_plain(runs)
    if compared:
        lines += ["", *compared]
    lines += ["", f"The worker's RSS per {s.get('quarter', 900):g} s of the run:", "",
              *quarter_table(runs, s.get("quarter", 900))]
    if plot is not None:
        lines += ["", f"![RSS, KV usage and p99 TTFT over time]({plot.name})"]
    for run in runs:
        lines += ["", f"## {run.name}", "", "Requests per policy (`none`: no setting sent):", "", *policy_table(run), "",
                  *malformed_table(run), "", "Idle points (clients paused until nothing runs or waits):", "",
                  *idle_table(run), "", f"Latency per {s['window']:g} s window (completed streams, by send time):", "",
                  *window_table(run, s["window"]), "", "Error texts:", "", *error_lines(run)]
    return "\n".join(lines)


def plot_runs(runs: Sequence[RunData], path: Path, window: float) -> Path:
    """One PNG: per run (columns) RSS, KV usage with running/waiting, p99 TTFT per window (rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(runs), figsize=(7 * len(runs), 9), sharex="col", squeeze=False)
    for col, run in enumerate(runs):
        rss_ax, kv_ax, lat_ax = axes[:, col]
        t = [s.t / 60 for s in run.samples]
        for role in ("api", "engine", "worker"):
            rss_ax.plot(t, [s.rss.get(role, float("nan")) for s in run.samples], label=role)
        rss_ax.set(title=f"{run.name}: RSS (MB)", ylabel="MB")
        rss_ax.legend(loc="center right")
        kv_ax.plot(t, [100 * s.metrics.get(USAGE, float("nan")) for s in run.samples], label="KV usage %")
        kv_ax.plot(t, [s.metrics.get(RUNNING, float("nan")) for s in run.samples], label="running", lw=0.8)
        kv_ax.plot(t, [s.metrics.get(WAITING, float("nan")) for s in run.samples], label="waiting", lw=0.8)
        kv_ax.scatter([p.t / 60 for p in run.idles], [100 * p.kv_usage for p in run.idles], color="k", zorder=3,
                      label="idle point KV %")
        for ax in (rss_ax, kv_ax, lat_ax):
            for start, end in run.waves:
                ax.axvspan(start / 60, end / 60, color="orange", alpha=0.12)
            for point in run.idles:
                ax.axvspan((point.t - point.waited) / 60, point.t / 60, color="grey", alpha=0.15)
        kv_ax.set(title="KV usage (%), running, waiting; waves orange, idle-point pauses grey")
        kv_ax.legend(loc="upper right", fontsize=7)
        rows = windows(run.results, window, run.settings["duration"])
        mids = [(start + window / 2) / 60 for start, _, _ in rows]
        for column, compressed, color in ((1, False, "C0"), (2, True, "C1")):
            mine = [r for r in run.results if r.outcome == "ok" and r.ttft is not None and r.draw.compressed is compressed]
            lat_ax.scatter([r.sent / 60 for r in mine], [r.ttft for r in mine], s=6, color=color, alpha=0.4)
            lat_ax.plot(mids, [row[column]["ttft99"] for row in rows], marker="o", color=color,
                        label=f"{'compressed' if compressed else 'uncompressed'} p99")
        lat_ax.set(title=f"TTFT by send time (dots) and p99 per {window:g} s window (s)", xlabel="minutes", ylabel="s")
        lat_ax.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_records(run: RunData, path: Path) -> Path:
    """The run's raw records as JSON lines: meta, then requests, samples, idle points, waves."""
    def line(kind: str, data: Any) -> str:
        return json.dumps({"kind": kind, **data}, default=str)

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        meta = {k: getattr(run, k) for k in ("name", "command", "labels", "left_out", "settings", "elapsed",
                                             "server_alive", "log_errors", "leftover")}
        out.write(line("meta", meta) + "\n")
        for r in run.results:
            record = dataclasses.asdict(r)
            record["itl"] = [round(gap, 4) for gap in r.itl]
            out.write(line("request", record) + "\n")
        for s in run.samples:
            out.write(line("sample", dataclasses.asdict(s)) + "\n")
        for p in run.idles:
            out.write(line("idle", dataclasses.asdict(p)) + "\n")
        for start, end in run.waves:
            out.write(line("wave", {"start": start, "end": end}) + "\n")
    return path


# ---------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The soak's flags."""
    add = parser.add_argument
    add("--model", default=None, help="model folder (default: the bundled SmolLM2)")
    add("--served-name", default=None, help="served model name (default: SmolLM2-135M-Instruct, or the folder name)")
    add("--duration", type=float, default=1200, help="seconds of load per run (default: %(default)s)")
    add("--clients", type=int, default=8, help="steady concurrent clients")
    add("--policies", default="all", help="'all' (none + every registered policy) or a comma list; 'none' = no header")
    add("--baseline", action="store_true", help="then run the same soak with full cache only (none, policy=full)")
    add("--plain", action="store_true",
        help="then run the same load (no compression setting, only the malformed requests vLLM refuses itself) on "
             "vLLM's own server without the plugin (its entry point left out through VLLM_PLUGINS), the same "
             "cores and flags: what vLLM's own memory does")
    add("--ratios", default="0.125,0.25,0.5")
    add("--min-prompt", type=int, default=256)
    add("--max-prompt", type=int, default=4096)
    add("--min-output", type=int, default=16)
    add("--max-output", type=int, default=256)
    add("--abort-share", type=float, default=0.10, help="streams the client closes early")
    add("--malformed-share", type=float, default=0.02, help="malformed requests (each must get 400)")
    add("--repeat-share", type=float, default=0.10, help="completions starting with a shared document")
    add("--wave-every", type=float, default=150, help="seconds between waves (0: none)")
    add("--wave-clients", type=int, default=8)
    add("--wave-seconds", type=float, default=45)
    add("--idle-every", type=float, default=300, help="seconds between idle points (0: only the final one)")
    add("--idle-timeout", type=float, default=60,
        help="idle point: longest wait, once every client has its answer, for running = waiting = 0")
    add("--sample-every", type=float, default=5)
    add("--trim-at-idle", action="store_true",
        help="at each idle point make every server process give its free heap back (glibc malloc_trim through "
             "gdb, which must be installed) and record RSS again: tells allocator retention from leaks")
    add("--warmup", type=float, default=180, help="seconds left out of the RSS slope fit")
    add("--quarter", type=float, default=900, help="seconds per row of the RSS-over-time table")
    add("--window", type=float, default=120, help="seconds per latency window in the report")
    add("--pool-blocks", type=int, default=2 * 72, help="KV blocks of 32 tokens (default: ~two full 2K requests)")
    add("--max-requests", type=int, default=20000, help="stop drawing after this many requests")
    add("--request-timeout", type=float, default=1800,
        help="a request with no complete answer by then is an error (queues on a small pool are long)")
    add("--seed", type=int, default=0)
    add("--logs", type=Path, default=Path("bench-logs"), help="server logs folder")


def _check_sizes(args: argparse.Namespace, max_positions: int) -> None:
    args.max_len = args.max_prompt + args.max_output + CHAT_MARGIN
    if max_positions and args.max_len > max_positions:
        raise SystemExit(f"--max-prompt + --max-output + {CHAT_MARGIN} = {args.max_len} is over the model's "
                         f"{max_positions} positions")
    if args.max_len > (args.pool_blocks - 1) * BLOCK_SIZE:
        raise SystemExit(f"a pool of {args.pool_blocks} blocks holds {(args.pool_blocks - 1) * BLOCK_SIZE} tokens, "
                         f"less than one request of {args.max_len}: raise --pool-blocks")


def soak_all(args: argparse.Namespace) -> list[RunData]:
    """The soak (and with ``--baseline`` the full-cache-only soak after it), each on its own server;
    every run's raw records written next to ``--out``."""
    from vllm_kvcomp.models import fetch_default_model

    if args.trim_at_idle and shutil.which("gdb") is None:
        raise SystemExit("--trim-at-idle calls malloc_trim in the server processes through gdb: install gdb "
                         "(Debian: apt-get install gdb) or leave the flag out")
    model_dir = Path(args.model) if args.model else fetch_default_model()
    args.served_name = args.served_name or (MODEL_NAME if args.model is None else model_dir.name)
    _check_sizes(args, model_facts(model_dir)[1])
    labels, left_out = policy_labels(args.policies, usable_policies(model_dir))
    plans = [("mixed" if any(label not in NO_COMPRESSION_WORDS for label in labels) else "baseline", labels)]
    if args.baseline:
        plans.append(("baseline", list(BASELINE_LABELS)))
    if args.plain:
        plans.append((PLAIN, [NO_HEADER]))
    runs = []
    for name, run_labels in plans:
        data = soak_run(args, name, run_labels, left_out if run_labels is labels else [], model_dir,
                        plugin=name != PLAIN)
        runs.append(data)
        write_records(data, args.out.with_name(f"{args.out.stem}_{name}.jsonl"))
    return runs


def run(args: argparse.Namespace) -> int:
    """Soak, write the report and the plot; exit status 1 when a run did not hold (:func:`verdict`)."""
    runs = soak_all(args)
    plot = plot_runs(runs, args.out.with_name(f"{args.out.stem}_timeline.png"), args.window)
    body = render(runs, plot)
    print(body)
    write_report(args.out, args.command, body)
    return 0 if all(verdict(data) for data in runs) else 1


def verdict(run: RunData) -> bool:
    """The run held: no 5xx, no request without an answer, every idle point clean, same engine."""
    return (not any(r.server_error or r.status is None for r in run.results)
            and all(p.clean for p in run.idles) and bool(run.idles) and not restarted(run))


def main(argv: list[str] | None = None) -> int:
    from vllm_kvcomp.bench import soak

    return module_main(soak, "soak", argv)


if __name__ == "__main__":
    raise SystemExit(main())
