"""Live server with two data-parallel engines: ``vllm-kvcomp serve --data-parallel-size 2``.

One ``vllm-kvcomp serve`` of the tiny model with two engine cores (one CPU set each, through
``VLLM_CPU_OMP_THREADS_BIND``) and two API server processes (``--api-server-count 2``, vLLM's
default for this data-parallel size). Requests are pinned to an engine with vLLM's
``X-data-parallel-rank`` header, so every engine's numbers are known in advance:

- a mixed load of compressed and uncompressed requests completes, and each engine's
  ``vllm:kvcomp_*`` counters equal the sums of the ``usage.kv_compression`` of the requests it
  served; their sum over ``engine`` labels equals the sum over all requests (nothing counted twice);
- the gauges are per engine: a running request shows its blocks on its own engine only, and
  they go back to 0 when it ends (the engines' stats reach either API server process);
- the operator config applies in both API server processes (which process answered is read
  from the server side of the client's connection).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.tiny_llama import make_tiny_llama
from tests.server.conftest import (
    BLOCK_SIZE,
    OPERATOR_CONFIG,
    TINY,
    Server,
    equal_budget_numbers,
    metric,
    poll_metrics,
    prompt_ids,
    serving,
)
from vllm_kvcomp.engine.metrics import GAUGES

pytestmark = pytest.mark.server

HEADER = "X-KV-Compression"
RANK = "X-data-parallel-rank"  # vLLM's own header: serve this request on that engine
ENGINES = ("0", "1")
POLL_S = 120  # the 2-core CI machine is shared: the API servers compete with both engines
MAX_MODEL_LEN = 24576  # 768 of the 1024 blocks: a request that decodes to it runs 20-75 s here
ATTEMPTS = 3  # long requests started in turn until one is seen running
SCRAPE_S = 5  # a /metrics answer slower than this is retried (the next may reach the other API server)


def thread_binding() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` with one CPU set per data-parallel rank ("0|1" on 2 cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    first, second = cpus[:half], cpus[half:] or cpus[:half]
    return "|".join(",".join(map(str, group)) for group in (first, second))


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("dp_server")
    model = make_tiny_llama(root / "tiny", **{**TINY, "max_position_embeddings": MAX_MODEL_LEN})
    env = pytest.MonkeyPatch()
    env.setenv("VLLM_CPU_OMP_THREADS_BIND", thread_binding())  # read by the engines at start
    try:
        with serving(root, model, OPERATOR_CONFIG, "--data-parallel-size", "2", "--api-server-count", "2",
                     "--max-model-len", str(MAX_MODEL_LEN)) as state:
            env.undo()
            yield state
    finally:
        env.undo()


def quick_scrape(server: Server) -> dict[tuple[str, frozenset], float]:
    """``/metrics`` as conftest's :func:`scrape` reads it, asked again when an answer takes more
    than SCRAPE_S: on the shared 2-core machine an API server process sometimes answers /metrics
    only after 10-30 s, long enough for a running request to end before its gauges are read."""
    deadline = time.monotonic() + POLL_S
    while True:
        try:
            with urllib.request.urlopen(f"{server.url}/metrics", timeout=SCRAPE_S) as response:
                text = response.read().decode()
            break
        except (TimeoutError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def wait_until(server: Server, check, timeout: float = POLL_S):
    """Scrape until ``check(samples)`` holds or ``timeout`` passes; the last scrape."""
    return poll_metrics(server, check, quick_scrape, timeout, period=0.2)


def complete(server: Server, prompt: list[int], rank: str, header: str | None) -> dict:
    headers = {RANK: rank} | ({HEADER: header} if header else {})
    response = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0,
                                                   extra_headers=headers)
    return response.usage.model_extra["kv_compression"]


# ---------------------------------------------------------------------------- counters


LOAD = [  # (engine, policy header or None, prompt tokens)
    ("0", "streamingllm; ratio=0.25", 800),
    ("0", None, 500),
    ("0", "snapkv; ratio=0.25", 900),
    ("0", "none", 416),
    ("1", "streamingllm; ratio=0.5", 700),
    ("1", "snapkv; ratio=0.5", 640),
    ("1", None, 300),
    ("1", "sagekv; ratio=0.25", 576),
]
COUNTERS = {  # series -> usage field it must sum
    "vllm:kvcomp_tokens_evicted_total": "tokens_evicted",
    "vllm:kvcomp_blocks_freed_total": "blocks_freed",
    "vllm:kvcomp_compression_seconds_count": "compressions",
    "vllm:kvcomp_achieved_ratio_count": "compressions",
}


def test_mixed_load_is_counted_once_on_the_engine_that_served_it(dp_server):
    before = quick_scrape(dp_server)
    with ThreadPoolExecutor(max_workers=4) as pool:
        usages = list(pool.map(lambda i: complete(dp_server, prompt_ids(LOAD[i][2], seed=500 + i), LOAD[i][0],
                                                  LOAD[i][1]), range(len(LOAD))))
    for (_, header, prompt), usage in zip(LOAD, usages):
        if header in (None, "none"):
            assert (usage["policy"], usage["compressions"], usage["tokens_evicted"]) == ("full", 0, 0)
        else:
            ratio = float(header.rsplit("=", 1)[1])
            expected = equal_budget_numbers(prompt, ratio)
            assert {key: usage[key] for key in expected} == expected, header
    compressed = sum(usage["compressions"] > 0 for usage in usages)
    assert compressed == 5

    def delta(samples, name, **labels):
        return metric(samples, name, **labels) - metric(before, name, **labels)

    after = wait_until(dp_server, lambda s: delta(s, "vllm:kvcomp_requests_compressed_total") >= compressed)
    served = {engine: [u for (e, _, _), u in zip(LOAD, usages) if e == engine] for engine in ENGINES}
    for engine, own in served.items():
        assert delta(after, "vllm:prompt_tokens_total", engine=engine) == sum(u["prompt_tokens"] for u in own)
        assert delta(after, "vllm:kvcomp_requests_compressed_total", engine=engine) == sum(
            u["compressions"] > 0 for u in own) > 0
        for name, field in COUNTERS.items():
            assert delta(after, name, engine=engine) == sum(u[field] for u in own) > 0, (name, engine)
    assert delta(after, "vllm:kvcomp_requests_compressed_total") == compressed
    for name, field in COUNTERS.items():
        assert delta(after, name) == sum(u[field] for u in usages), name
    assert delta(after, "vllm:kvcomp_requests_compressed_total", policy="full") == 0
    engines = {dict(labels).get("engine") for (name, labels) in after if name.startswith("vllm:kvcomp_")}
    assert engines == set(ENGINES)


# ---------------------------------------------------------------------------- gauges


#: the gauges of running requests (reserved_bytes is the engine's start-up bound: constant)
REQUEST_GAUGES = [name for name in GAUGES if name != "reserved_bytes"]


def gauges(samples, engine: str) -> dict[str, float]:
    return {name: metric(samples, f"vllm:kvcomp_{name}", engine=engine) for name in REQUEST_GAUGES}


class LongRequest:
    """A snapkv request pinned to ``engine`` that decodes to the model's length, its answer read by
    a background thread; :meth:`abort` closes the connection (vLLM aborts the request). Not
    streamed: the API server then formats no token."""

    def __init__(self, server: Server, prompt: int, engine: str, seed: int):
        url = urlparse(server.url)
        self.connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10 * POLL_S)
        body = {"model": server.model, "prompt": prompt_ids(prompt, seed=seed), "temperature": 0,
                "max_tokens": MAX_MODEL_LEN - prompt - 1, "ignore_eos": True}
        self.connection.request("POST", "/v1/completions", json.dumps(body), {
            "Content-Type": "application/json", HEADER: "snapkv; ratio=0.25", RANK: engine})
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.answer = self.pool.submit(lambda: json.loads(self.connection.getresponse().read()))

    def abort(self) -> None:
        if not self.answer.done():
            self.connection.sock.shutdown(socket.SHUT_RDWR)  # the reader thread returns with an error
        self.connection.close()
        self.pool.shutdown()


@pytest.mark.parametrize(("engine", "prompt"), [("1", 640), ("0", 900)])
def test_gauges_show_the_running_requests_of_their_own_engine(dp_server, engine, prompt):
    """One engine at a time: with both decoding, the 2-core machine left the API servers so little
    CPU that most /metrics answers took 15-30 s.

    Even with one engine decoding, a /metrics answer took 1-22 s here, and a request decoding to
    the model's length lasted 20-75 s: one that ends before its gauges are read is checked by its
    usage and replaced by a new one (at most ATTEMPTS)."""
    other = ENGINES[1 - ENGINES.index(engine)]
    expected = equal_budget_numbers(prompt, 0.25)
    freed = expected["blocks_freed"]
    before = wait_until(dp_server, lambda s: not any(gauges(s, engine).values()))  # the last test's request ended
    assert gauges(before, engine) == dict.fromkeys(REQUEST_GAUGES, 0)
    for attempt in range(ATTEMPTS):
        request = LongRequest(dp_server, prompt, engine, seed=600 + 10 * attempt + int(engine))
        try:
            running = wait_until(dp_server, lambda s, answer=request.answer: (
                answer.done() or gauges(s, engine)["saved_blocks"] == freed), timeout=10 * POLL_S)
            ended = gauges(running, engine)["saved_blocks"] != freed
        finally:
            request.abort()
        if not ended:
            break
        usage = request.answer.result()["usage"]["kv_compression"]  # it ran to the end unseen: it did compress
        assert {key: usage[key] for key in expected} == expected
    else:
        pytest.fail(f"{ATTEMPTS} requests ended before /metrics showed their gauges")
    own = gauges(running, engine)
    assert metric(running, "vllm:kvcomp_reserved_bytes", engine=engine) > 0  # its memory outside the KV pool
    assert own["saved_blocks"] == freed > 0
    assert own["held_blocks"] + own["saved_blocks"] == own["uncompressed_blocks"] > prompt // BLOCK_SIZE
    assert gauges(running, other) == dict.fromkeys(REQUEST_GAUGES, 0)
    idle = wait_until(dp_server, lambda s: not any(gauges(s, engine).values()))
    assert gauges(idle, engine) == dict.fromkeys(REQUEST_GAUGES, 0)


# ---------------------------------------------------------------------------- operator config


def api_servers(server: Server) -> set[int]:
    """PIDs of the server's API server processes: vLLM's ``APIServer_N`` children listening on its port."""
    port = urlparse(server.url).port
    found = set()
    for process in psutil.Process().children(recursive=True):
        try:
            if "APIServer" in " ".join(process.cmdline()) and any(
                    c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in process.net_connections("tcp")):
                found.add(process.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def post(server: Server, candidates: set[int], body: dict, header: str) -> tuple[int, dict, dict, int | None]:
    """POST /v1/completions; (status, body, headers, PID of the API server that answered it)."""
    url = urlparse(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=POLL_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json", HEADER: header})
        response = connection.getresponse()
        payload = json.loads(response.read())
        client_port = connection.sock.getsockname()[1]  # still open: HTTP/1.1 keep-alive
        owner = next((pid for pid in candidates for c in psutil.Process(pid).net_connections("tcp")
                      if c.raddr and c.raddr.port == client_port and c.laddr.port == url.port), None)
        return response.status, payload, {k.lower(): v for k, v in response.getheaders()}, owner
    finally:
        connection.close()


def test_operator_config_applies_in_every_api_server_process(dp_server):
    processes = api_servers(dp_server)
    assert len(processes) == 2, processes
    body = {"model": dp_server.model, "prompt": prompt_ids(40, seed=700), "max_tokens": 1}
    answered: dict[int | None, set[str]] = {pid: set() for pid in processes}
    for attempt in range(200):
        if attempt % 2:  # entropy is not in the operator's allow list
            status, payload, _, owner = post(dp_server, processes, body, "policy=entropy")
            assert status == 400, payload
            assert payload["error"]["param"] == f"{HEADER}.policy"
            answered.setdefault(owner, set()).add("refused")
        else:  # lag and sink come from the operator's policies.lagkv
            status, payload, headers, owner = post(dp_server, processes, body, "policy=lagkv; ratio=0.5")
            assert status == 200, payload
            applied = headers["x-kv-compression-applied"]
            assert "lag=32" in applied and "sink=4" in applied, applied
            answered.setdefault(owner, set()).add("defaults")
        if all(kinds == {"refused", "defaults"} for kinds in answered.values()):
            break
    assert answered == {pid: {"refused", "defaults"} for pid in processes}
