"""One live ``vllm-kvcomp serve`` (tiny random Llama, CPU) shared by every live server test.

Started as ``python -m vllm_kvcomp serve`` on 127.0.0.1 and a free port with only the flags a
test setup needs (block size, a small block pool, the operator config below, the scale-out
routes): dtype, eager mode, max model length and the memory fraction come from the CLI's CPU
defaults. Killed at the end; a failing test that used it gets the tail of the server log in its
report. :func:`serving` starts another one (test_live_policies.py: the README set-up).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.tiny_llama import make_tiny_llama

BLOCK_SIZE = 32
NUM_BLOCKS = 1024
TINY = dict(num_layers=3, hidden_size=192, num_heads=6, num_kv_heads=2, head_dim=32,
            intermediate_size=256, vocab_size=512, seed=0)
KV_CELLS_PER_TOKEN = TINY["num_layers"] * TINY["num_kv_heads"]  # (layer, KV head) pairs
OPERATOR_CONFIG = """\
allow: [full, streamingllm, snapkv, h2o, knorm, sagekv, lagkv, razor, pod]  # no entropy
policies:
  lagkv: {lag: 32, sink: 4}
"""
START_TIMEOUT_S = 300
LOG_TAIL_LINES = 80


@dataclass(frozen=True)
class Server:
    url: str
    model: str
    config_path: Path
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60, **kwargs)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (engine core and workers too), then SIGKILL."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@contextlib.contextmanager
def serving(root: Path, model: Path, config: str | None, *extra: str) -> Iterator[Server]:
    """``python -m vllm_kvcomp serve MODEL`` on a free port with ``config`` (None: no config file)."""
    config_path = root / "operator.yaml"
    command = [
        sys.executable, "-m", "vllm_kvcomp", "serve", str(model),
        "--host", "127.0.0.1", "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
        *extra,
    ]
    if config is not None:
        config_path.write_text(config)
        command += ["--kv-compression-config", str(config_path)]
    port = _free_port()
    state = Server(f"http://127.0.0.1:{port}", str(model), config_path, root / "server.log")
    with state.log_path.open("wb") as log:
        process = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(state.url):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not come up (exit code {process.poll()}):\n{state.log_tail()}")
            time.sleep(1)
        yield state
    finally:
        _stop(process)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared server: the operator config above, the scale-out routes enabled."""
    root = tmp_path_factory.mktemp("server")
    model = make_tiny_llama(root / "tiny", **TINY)
    with serving(root, model, OPERATOR_CONFIG, "--enable-scale-out") as state:
        yield state


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the server log tail to failing tests that used the live server."""
    outcome = yield
    report = outcome.get_result()
    for server_state in getattr(item, "funcargs", {}).values():
        if report.failed and isinstance(server_state, Server):
            report.sections.append((f"server log (tail) {server_state.url}", server_state.log_tail()))


# ---------------------------------------------------------------------------- helpers for tests


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic random prompt of ``n`` token ids (special tokens excluded)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, TINY["vocab_size"]) for _ in range(n)]


def chat_text(words: int, seed: int) -> str:
    """A user message of ``words`` random lower-case words."""
    import random

    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 6))) for _ in range(words))


def equal_budget_numbers(prompt_tokens: int, ratio: float) -> dict[str, int]:
    """What an equal-per-head policy (streamingllm, snapkv, ...) must report after one compression:
    ``ceil(ratio * N)`` kept per head, rounded up to the page grid (``≡ N mod block_size``); the
    packed pages of all heads fill ``(kept - N % bs) / bs`` blocks below the prompt's last one."""
    import math

    residue = prompt_tokens % BLOCK_SIZE
    kept = min(prompt_tokens, math.ceil(ratio * prompt_tokens) + (residue - math.ceil(ratio * prompt_tokens)) % BLOCK_SIZE)
    return {
        "tokens_kept": kept,
        "tokens_evicted": (prompt_tokens - kept) * KV_CELLS_PER_TOKEN,
        "blocks_freed": prompt_tokens // BLOCK_SIZE - (kept - residue) // BLOCK_SIZE,
        "compressions": 1,
    }


def scrape(server: Server) -> dict[tuple[str, frozenset], float]:
    """``/metrics`` as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def poll_metrics(server: Server, check, read=None, timeout: float = 15.0, period: float = 0.1):
    """Read ``/metrics`` (with ``read``, default :func:`scrape`) until ``check(samples)`` holds or
    ``timeout`` passes (stats reach the API server step by step); the last reading."""
    read = read or scrape
    deadline = time.monotonic() + timeout
    while True:
        samples = read(server)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(period)


def metric(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)
