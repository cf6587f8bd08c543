"""The support matrix (docs/compatibility.md), generated from these tests so it cannot drift.

Each row of :data:`ROWS` is a model family (a tiny random model built here: 2 layers, the
shared 512-token tokenizer, float32; tests/helpers/tiny_families.py) or an engine feature on the
tiny Llama every engine test uses (tests/engine/conftest.py ``TINY``). Each engine runs in a child
process (tests/engine/stream_engine.py), one batch: an uncompressed request, a ``snapkv`` and a
``lagkv`` request at ``ratio=0.25`` (and, where a row needs it, a ``prefill=stream`` request or a
second, warm batch). Each row records whether the engine serves (the uncompressed request
completes), whether it compresses (every compressed request reports ``compressions >= 1`` and
``kept_fraction < 0.5``), or what it reports when it cannot (``applied: none`` and ``reason``).
A family whose engine fails is run again on plain vLLM (no connector): if plain vLLM fails too,
the row reads "not served by vLLM CPU 0.32: <its error>"; if only our connector fails, its test
fails (a bug, never a row of the matrix).

:data:`EXPECTED` is what each row must show (a change of behaviour fails its test);
``test_the_doc_is_generated_from_these_outcomes`` renders the matrix from the outcomes and
compares it with docs/compatibility.md. After a deliberate change, regenerate the doc with

    python -m tests.engine.test_compatibility

which runs the same engines and writes the file (no pytest option: the module's ``__main__``).

Engines run two at a time (:data:`PARALLEL`): 18 engines of 20-40 s each on two cores (mostly
vLLM's import; about 6 minutes of CPU in all).
Oracle equality (engine == HF) for these families is tested elsewhere (test_oracle_equality.py,
test_model_variants.py, test_hybrid.py); this module records what is served and compressed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.engine import test_backend_choice as backend_choice
from tests.engine.conftest import TINY, prompt_ids
from tests.engine.stream_engine import ROOT, engine_request, run_engine
from vllm_kvcomp.spec import CompressionSpec

pytestmark = pytest.mark.engine

DOC = ROOT / "docs" / "compatibility.md"
COMMAND = "python -m tests.engine.test_compatibility"
PARALLEL = 2
MAX_TOKENS = 6
POOL = 300
SPECS = {
    "snapkv": {"policy": "snapkv", "ratio": 0.25, "window": 8},
    "lagkv": {"policy": "lagkv", "ratio": 0.25, "sink": 4, "lag": 32},
    "lagkv-stream": {"policy": "lagkv", "ratio": 0.25, "sink": 4, "lag": 32, "prefill": "stream"},
}
#: prompt length and seed per request (token ids < 512: every tiny vocabulary covers them)
PROMPTS = {"plain": (300, 1), "snapkv": (420, 2), "lagkv": (540, 3), "lagkv-stream": (560, 4)}
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


@dataclass(frozen=True)
class Engine:
    """One child engine: the model (a tests/helpers/tiny_families.py builder, or ``tiny-llama``),
    the prefill chunk, ``LLM`` keyword arguments (``engine_args``; ``overrides`` for the ones
    stream_engine fixes itself, e.g. ``enable_prefix_caching``), the requests of its batch and
    whether the batch runs a second time (warm: the prefix cache the first run filled)."""

    model: str
    chunk: int = 512
    engine_args: dict = field(default_factory=dict)
    overrides: dict | None = None
    requests: tuple[str, ...] = ("plain", "snapkv", "lagkv")
    warm: bool = False


@dataclass(frozen=True)
class Row:
    """One line of the matrix: which engine, what it exercises, which compressed requests count,
    and whether its outcome is a known limitation (linked to docs/engine.md#exactness)."""

    name: str
    label: str
    exercises: str
    engine: str
    policies: tuple[str, ...] = ("snapkv", "lagkv")
    limitation: bool = False


ENGINES = {
    "llama3": Engine("make_tiny_llama3"),
    "qwen2": Engine("make_tiny_qwen2"),
    "qwen2.5": Engine("make_tiny_qwen2_5"),
    "qwen3": Engine("make_tiny_qwen3"),
    "mistral": Engine("make_tiny_mistral"),
    "mistral-swa": Engine("make_tiny_mistral_swa"),
    "mixtral": Engine("make_tiny_mixtral"),
    "phi3": Engine("make_tiny_phi3"),
    "granite": Engine("make_tiny_granite"),
    "olmo2": Engine("make_tiny_olmo2"),
    "gemma2": Engine("make_tiny_gemma2"),
    "gemma3": Engine("make_tiny_gemma3"),
    "gpt-oss": Engine("make_tiny_gpt_oss"),
    "deepseek-v2": Engine("make_tiny_deepseek_v2"),
    "ngram": Engine("tiny-llama", engine_args={"speculative_config": NGRAM}),
    "prefix": Engine("tiny-llama", overrides={"enable_prefix_caching": True}, warm=True),
    "chunked": Engine("tiny-llama", chunk=128, requests=("plain", "snapkv", "lagkv", "lagkv-stream")),
    "async": Engine("tiny-llama", overrides={"async_scheduling": True}),
}

ROWS = [
    Row("llama3", "Llama 3.x", "GQA 8:1 (8 query heads, 1 KV head), `llama3` RoPE scaling", "llama3"),
    Row("qwen2", "Qwen2", "q/k/v projection biases", "qwen2"),
    Row("qwen2.5", "Qwen2.5", "the Qwen2 architecture, tied embeddings, RoPE θ 1e6", "qwen2.5"),
    Row("qwen3", "Qwen3", "RMS norm on each query / key head", "qwen3"),
    Row("mistral", "Mistral, no sliding window", "`sliding_window: null`", "mistral"),
    Row("mistral-swa", "Mistral with `sliding_window`", "window 128 on every layer (Mistral 7B v0.1's config)",
        "mistral-swa", limitation=True),
    Row("mixtral", "Mixtral", "MoE: 4 experts, 2 per token", "mixtral"),
    Row("phi3", "Phi-3", "fused qkv and gate/up projections", "phi3"),
    Row("granite", "Granite", "attention multiplier 0.25 as the softmax scale; embedding / residual / logit "
        "multipliers", "granite"),
    Row("olmo2", "OLMo 2", "RMS norm over the whole q / k projections, norms after attention and MLP", "olmo2"),
    Row("gemma2", "Gemma 2", "logit soft-capping at 50 (q/k x16: active), sliding (128) / global layers "
        "alternating, 4 layers", "gemma2"),
    Row("gemma3", "Gemma 3", "hybrid: 5 sliding-window (128) layers + 1 global, 6 layers", "gemma3"),
    Row("gpt-oss", "gpt-oss", "learned attention sinks (~+8: active), MoE, sliding / full layers alternating, "
        "4 layers", "gpt-oss"),
    Row("deepseek-v2", "DeepSeek-V2 (MLA)", "multi-head latent attention: `kv_lora_rank` 512 (vLLM CPU 0.32's MLA "
        "decode kernel takes only a 576-wide latent, 512 + 64 RoPE), q/k head 64 + 64 RoPE, v head 64; MoE",
        "deepseek-v2", limitation=True),
    Row("ngram", "`--speculative-config` ngram", "ngram speculation, 2 draft tokens verified over the compressed "
        "requests' packed pages, rejected ones rolled back (engine == oracle: test_speculative.py)", "ngram"),
    Row("prefix", "prefix caching on", "the batch twice: the second run reads the first's cached prompt blocks",
        "prefix"),
    Row("chunked", "chunked prefill", "`max_num_batched_tokens` 128: every prompt in several chunks", "chunked"),
    Row("prefill-stream", "`prefill=stream`", "lagkv compressing after every prefill chunk (chunk 128)",
        "chunked", policies=("lagkv-stream",)),
    Row("async", "`--async-scheduling`", "`async_scheduling=True` on the in-process engine", "async"),
]
ROW = {row.name: row for row in ROWS}

#: what each row must show: "compresses", "uncompressed: <reason substring>" or
#: "not served: <error substring>"
EXPECTED = {
    **{name: "compresses" for name in ("llama3", "qwen2", "qwen2.5", "qwen3", "mistral", "mixtral", "phi3",
                                         "granite", "olmo2", "gemma2", "gemma3", "gpt-oss", "prefix", "chunked",
                                         "prefill-stream", "async", "ngram")},
    "mistral-swa": "uncompressed: no single full-attention KV-cache group",
    "deepseek-v2": "uncompressed: multi-head latent attention",
}

# ----------------------------------------------------------------------------- running engines

#: stream_engine's main with ``LLM`` keyword arguments overridden (the last argv entry, JSON), the
#: effective config and every finished request's prefix-cache hits printed
_CHILD = """
import json, sys
import vllm
from vllm.v1.engine.llm_engine import LLMEngine
overrides, made = json.loads(sys.argv.pop()), []
class _LLM(vllm.LLM):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, **overrides})
        made.append(self)
vllm.LLM = _LLM
_step = LLMEngine.step
def step(self):
    outputs = _step(self)
    for out in outputs:
        if out.finished:
            print("CACHED " + json.dumps([out.request_id, out.num_cached_tokens]), flush=True)
    return outputs
LLMEngine.step = step
from tests.engine import stream_engine
stream_engine.main()
config = made[0].llm_engine.vllm_config
print("CONFIG " + json.dumps({"enable_prefix_caching": config.cache_config.enable_prefix_caching,
                              "async_scheduling": config.scheduler_config.async_scheduling}), flush=True)
"""


def _run_overridden(model_dir: Path, engine: Engine, batches: list[list[dict]]) -> dict:
    """run_engine's protocol through :data:`_CHILD`; fails as run_engine does."""
    args = [str(model_dir), str(engine.chunk), str(POOL), "2048", "0", "1", "1", json.dumps(engine.engine_args),
            json.dumps(engine.overrides)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], input=json.dumps(batches), capture_output=True,
                          text=True, cwd=ROOT, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tagged: dict[str, list] = {"RESULT": [], "FREE": [], "CONFIG": [], "CACHED": []}
    for line in proc.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag in tagged:
            tagged[tag].append(json.loads(rest))
    return {"results": tagged["RESULT"], "free": tagged["FREE"][0], "config": tagged["CONFIG"][0],
            "cached": {rid: n for rid, n in tagged["CACHED"]}}


def _batches(engine: Engine, plain_only: bool = False) -> list[list[dict]]:
    def batch(prefix: str) -> list[dict]:
        return [engine_request(prefix + name, prompt_ids(*PROMPTS[name]),
                               None if plain_only or name == "plain" else SPECS[name], MAX_TOKENS)
                for name in engine.requests]

    return [batch(""), batch("warm-")] if engine.warm else [batch("")]


def error_line(stderr: str) -> str:
    """The exception a failed child died of (``ValueError: ...``), else its last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in stderr.splitlines()]
    lines = [line for line in lines if line]
    pattern = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)(: .*)?$")
    return next((line for line in reversed(lines) if pattern.match(line)), lines[-1] if lines else "(no output)")


def build_model(engine: Engine, directory: Path) -> Path:
    from tests.helpers import tiny_families
    from tests.helpers.tiny_llama import make_tiny_llama

    path = directory / engine.model
    if path.exists():
        return path
    if engine.model == "tiny-llama":
        return make_tiny_llama(path, **TINY)
    if engine.model == "make_tiny_mistral_swa":
        return tiny_families.make_tiny_mistral(path, sliding_window=128)
    return getattr(tiny_families, engine.model)(path)


def run_one(name: str, model_dir: Path) -> dict:
    """Everything one engine tells: its results (by request name), the pool at the end, the
    effective config and prefix-cache hits (overridden engines), or the error it (and plain vLLM)
    failed with."""
    engine = ENGINES[name]
    start = time.monotonic()
    try:
        if engine.overrides is None:
            results, free = run_engine(model_dir, engine.chunk, _batches(engine), pool=POOL,
                                       engine_args=engine.engine_args)
            run = {"results": results, "free": free, "config": None, "cached": {}}
        else:
            run = _run_overridden(model_dir, engine, _batches(engine))
    except AssertionError as failed:
        run = {"error": error_line(str(failed))}
        try:  # the same engine without our connector
            run_engine(model_dir, engine.chunk, _batches(engine, plain_only=True), pool=POOL, connector=False,
                       engine_args=engine.engine_args)
            run["plain_error"] = None
        except AssertionError as plain:
            run["plain_error"] = error_line(str(plain))
    run["results"] = {r["name"].rsplit("-", 1)[0]: r for r in run.get("results", [])}
    run["seconds"] = round(time.monotonic() - start, 1)
    return run


def run_engines(names: list[str], directory: Path) -> dict[str, dict]:
    """Build the models here, one after another (transformers' lazy imports are not thread-safe),
    then run their engines :data:`PARALLEL` at a time."""
    model_dirs = [build_model(ENGINES[name], directory) for name in names]
    with ThreadPoolExecutor(PARALLEL) as pool:
        return dict(zip(names, pool.map(run_one, names, model_dirs)))


# ----------------------------------------------------------------------------- outcomes


def outcome(row: Row, run: dict) -> dict:
    """A row's outcome: ``status`` (compresses / uncompressed / not served / connector failure),
    ``served``, per-policy ``kept`` fractions and ``compressions``, the ``reason`` or ``error``,
    and a measured ``note``."""
    if "error" in run:
        if run["plain_error"] is None:
            return {"status": "connector failure", "served": False, "error": run["error"]}
        differs = "" if run["error"] == run["plain_error"] else f" (with the kvcomp connector: {run['error']})"
        return {"status": "not served", "served": False, "error": run["plain_error"] + differs}
    results = run["results"]
    plain = results["plain"]
    served = plain.get("kvcomp") is None and len(plain.get("tokens", [])) == MAX_TOKENS
    asked = {policy: results[policy]["kvcomp"] or {} for policy in row.policies}
    compressed = all(r.get("compressions", 0) >= 1 and r.get("kept_fraction", 1.0) < 0.5 for r in asked.values())
    declined = all(r.get("applied") == "none" for r in asked.values())
    reasons = sorted({r.get("reason") for r in asked.values() if r.get("reason")})
    status = "compresses" if compressed else "uncompressed" if declined else "partly compressed"
    return {"status": status, "served": served, "applied": {p: r.get("applied") for p, r in asked.items()},
            "kept": {p: r.get("kept_fraction") for p, r in asked.items()},
            "compressions": {p: r.get("compressions") for p, r in asked.items()},
            "reason": "; ".join(reasons) or None, "note": _note(row, run)}


def _note(row: Row, run: dict) -> str:
    """What the row measured beyond served / compressed (deterministic: it goes into the doc)."""
    results = run["results"]
    if row.name == "prefix":
        hits = ", ".join(f"{name} {run['cached'][results['warm-' + name]['name']]}"
                         for name in ENGINES["prefix"].requests)
        same = all(results["warm-" + name]["tokens"] == results[name]["tokens"] for name in ENGINES["prefix"].requests)
        return f"warm run's prompt tokens read from the cache: {hits}; {'same' if same else 'different'} tokens as cold"
    if row.name in ("chunked", "prefill-stream"):
        names = ("plain", *row.policies)
        chunks = ", ".join(f"{_label(name)} {_chunks(results[name])}" for name in names)
        return f"prefill chunks: {chunks}"
    if row.name == "async":
        return f"effective `async_scheduling`: {run['config']['async_scheduling']}"
    return ""


def _chunks(result: dict) -> int:
    """Prefill chunks a request was computed in (stream_engine records a leading 0 for a request
    the first step did not reach)."""
    return len([end for end in result["chunk_ends"] if end > 0])


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, dict]:
    """The engines the selected tests of this module need (all of them for the doc test)."""
    selected = [item for item in request.session.items if item.module is request.module]
    if any(item.name == test_the_doc_is_generated_from_these_outcomes.__name__ for item in selected):
        names = list(ENGINES)
    else:
        rows = {item.callspec.params["row"] for item in selected if hasattr(item, "callspec")}
        names = sorted({ROW[row].engine for row in rows})
    return run_engines(names, tmp_path_factory.mktemp("families"))


def row_outcome(runs: dict, name: str) -> dict:
    row = ROW[name]
    return outcome(row, runs[row.engine])


@pytest.mark.parametrize("row", [row.name for row in ROWS])
def test_row(runs, row):
    """The row shows what :data:`EXPECTED` says: compressed requests compress (applied is the
    spec, at least one compression, kept < 0.5), or are served with ``applied: none`` and the
    reason, or plain vLLM itself cannot serve the model. A failure with our connector only fails."""
    got = row_outcome(runs, row)
    run = runs[ROW[row].engine]
    assert got["status"] != "connector failure", (
        f"{row}: the engine fails with the kvcomp connector but plain vLLM serves it: {got['error']}")
    kind, _, detail = EXPECTED[row].partition(": ")
    assert got["status"] == kind, f"{row}: expected {EXPECTED[row]!r}, got {got}"
    if kind == "not served":
        assert detail in got["error"]
        return
    assert got["served"], f"{row}: the uncompressed request did not complete: {run['results']['plain']}"
    assert run["free"]["free"] == run["free"]["total"], f"{row}: blocks left in the pool: {run['free']}"
    if kind == "compresses":
        for policy, applied in got["applied"].items():
            assert applied == _spec(policy)
    else:
        assert detail in got["reason"], f"{row}: reason {got['reason']!r}"
        for policy in ROW[row].policies:
            result = run["results"][policy]
            assert result["kvcomp"]["kept_fraction"] == 1.0 and result["kvcomp"]["compressions"] == 0
            assert result["kvcomp"]["requested"].startswith(f"policy={SPECS[policy]['policy']}")
            assert len(result["tokens"]) == MAX_TOKENS


@pytest.mark.parametrize("row", ["prefix"])
def test_prefix_cache_is_hit_and_changes_nothing(runs, row):
    """The warm run reads the cold run's blocks (compressed requests stop before snapkv's window)
    and answers exactly as the cold run did."""
    run = runs["prefix"]
    assert run["config"]["enable_prefix_caching"] is True
    for name in ENGINES["prefix"].requests:
        cold, warm = run["results"][name], run["results"]["warm-" + name]
        assert warm["tokens"] == cold["tokens"] and warm["logprobs"] == pytest.approx(cold["logprobs"], abs=1e-4)
        assert run["cached"][warm["name"]] >= 256, f"{name}: {run['cached']}"


@pytest.mark.parametrize("row", ["chunked", "prefill-stream"])
def test_prefills_were_chunked(runs, row):
    results = runs["chunked"]["results"]
    for name in ("plain", *ROW[row].policies):
        assert _chunks(results[name]) >= 3, f"{name}: {results[name]['chunk_ends']}"


@pytest.mark.parametrize("row", ["prefill-stream"])
def test_streamed_prefill_compresses_during_the_prefill(runs, row):
    """Compressed after prefill chunks, not only once the prompt is in: more compressions than
    the same policy without streaming (1), at most one per chunk."""
    results = runs["chunked"]["results"]
    streamed, whole = results["lagkv-stream"]["kvcomp"], results["lagkv"]["kvcomp"]
    assert whole["compressions"] < streamed["compressions"] <= _chunks(results["lagkv-stream"]), streamed


def test_vllm_cpu_mla_takes_only_deepseeks_latent_width():
    """Why the DeepSeek-V2 model has ``kv_lora_rank`` 512 (its row says so): vLLM CPU's MLA decode
    kernel supports one latent width; a rank-64 model fails in plain vLLM ("Head dimension 128 is
    not supported by MLA.")."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    assert CPUMLABackend.get_supported_head_sizes() == [512 + 64]


def test_error_line_is_the_exception_a_child_died_of():
    stderr = ("Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
              "[rank0]: ValueError: Head dimension 128 is not supported by MLA.\n\nsome shutdown noise\n")
    assert error_line(stderr) == "ValueError: Head dimension 128 is not supported by MLA."
    assert error_line("killed\n") == "killed"


def test_failed_engines_are_told_apart_by_plain_vllm():
    """The paths no row takes today: plain vLLM fails too (the row says "not served by vLLM CPU"),
    or only our connector fails (a bug: test_row fails on it, the doc would say so)."""
    error = "ValueError: Head dimension 128 is not supported by MLA."
    row = ROW["deepseek-v2"]
    refused = outcome(row, {"error": error, "plain_error": error, "results": {}})
    assert refused["status"] == "not served" and refused["error"] == error
    assert f"not served by vLLM CPU 0.32: `{error}`" in _served(refused)
    bug = outcome(row, {"error": error, "plain_error": None, "results": {}})
    assert bug["status"] == "connector failure" and "a bug" in _served(bug)
    other = outcome(row, {"error": "KeyError: 'x'", "plain_error": error, "results": {}})
    assert other["error"] == f"{error} (with the kvcomp connector: KeyError: 'x')"


@pytest.mark.parametrize("row", ["async"])
def test_async_scheduling_is_turned_off_by_vllm_cpu(runs, row):
    """vLLM CPU 0.32 sets ``scheduler_config.async_scheduling = False`` (platforms/cpu.py): the row
    records a synchronous engine. When vLLM CPU honours it, this fails and the row needs a look."""
    assert runs["async"]["config"]["async_scheduling"] is False


# ----------------------------------------------------------------------------- the doc


def _label(request: str) -> str:
    return {"lagkv-stream": "lagkv `prefill=stream`"}.get(request, request)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _spec(policy: str) -> str:
    return CompressionSpec.from_mapping(SPECS[policy]).to_header()


def _served(got: dict) -> str:
    if got["status"] == "not served":
        return f"no: not served by vLLM CPU 0.32: `{got['error']}`"
    if got["status"] == "connector failure":
        return f"no: fails only with the kvcomp connector (a bug): `{got['error']}`"
    return ("yes" if got["served"] else "no") + (f" ({got['note']})" if got.get("note") else "")


def render(outcomes: dict[str, dict]) -> str:
    """docs/compatibility.md from the rows' outcomes."""
    lines = [
        "# Compatibility: model families and engine features",
        "",
        f"Generated by `{COMMAND}` from `tests/engine/test_compatibility.py`, which checks",
        "every row below (CI fails when a row changes; rerun the command to regenerate). Do not edit by hand.",
        "",
        "What was run: vLLM CPU 0.32, float32, `--enforce-eager`, block size 32, on tiny random models built",
        "in the test (2 layers unless noted, GQA where the family has it, the shared 512-token tokenizer;",
        "`tests/helpers/tiny_families.py`) — architecture coverage, not quality. Each engine serves one",
        f"batch of three greedy requests of {MAX_TOKENS} tokens: uncompressed "
        f"({PROMPTS['plain'][0]}-token prompt), `{_spec('snapkv')}`",
        f"({PROMPTS['snapkv'][0]} tokens) and `{_spec('lagkv')}` ({PROMPTS['lagkv'][0]} tokens).",
        "*Served*: the uncompressed request completes. *Compressed*: every compressed request reports",
        "`compressions >= 1` and `kept_fraction < 0.5` (kept fractions are above 0.25: kept tokens are",
        "rounded up to whole pages, a page being 32 tokens of a 300-540-token prompt). When the engine",
        "cannot compress, the request is still served and reports `applied: none` with the engine's `reason`",
        "([server.md](server.md#responses)). Features run on the tiny Llama of the engine tests",
        f"({TINY['num_layers']} layers, {TINY['num_heads']} query / {TINY['num_kv_heads']} KV heads).",
        "That the compressed outputs equal the HF oracle is tested elsewhere",
        "([engine.md](engine.md#exactness)).",
        "",
        "| family / feature | what it exercises | served | compressed (policies tried) | kept fraction at 0.25 "
        "| reason when not compressed |",
        "|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        got = outcomes[row.name]
        served = _served(got)
        tried = ", ".join(_label(p) for p in row.policies)
        if got["status"] == "compresses":
            compressed = f"yes ({tried})"
            kept = ", ".join(f"{_label(p)} {got['kept'][p]:.3f}" for p in row.policies)
            reason = "—"
        elif got["status"] == "uncompressed":
            compressed = f"no: `applied: none` ({tried})"
            kept = "1.0 (nothing evicted)"
            reason = got["reason"]
        else:
            compressed, kept, reason = f"no ({got['status']})", "—", got.get("reason") or got.get("error") or "—"
        if row.limitation:
            reason += " — [known limitation](engine.md#exactness)"
        cells = [row.label, row.exercises, served, compressed, kept, reason]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += [
        "",
        "Not run here: `n > 1` sampling (the child engine runs one sample per request; what",
        "`usage.kv_compression` reports for it: [server.md](server.md#notes)).",
        "",
        "## On a GPU: the attention backend vLLM picks, and engine settings",
        "",
        backend_choice.section(),
        "",
    ]
    return "\n".join(lines)


def test_the_doc_is_generated_from_these_outcomes(runs):
    outcomes = {row.name: outcome(row, runs[row.engine]) for row in ROWS}
    text = render(outcomes)
    current = DOC.read_text() if DOC.exists() else ""
    assert current == text, f"docs/compatibility.md is out of date with the engine; regenerate it: {COMMAND}"


def main() -> None:
    """Run every engine and write docs/compatibility.md (timings on stdout)."""
    with tempfile.TemporaryDirectory() as directory:
        start = time.monotonic()
        all_runs = run_engines(list(ENGINES), Path(directory))
    for name, run in all_runs.items():
        print(f"{name:12s} {run['seconds']:6.1f} s  {run.get('error') or ''}")
    outcomes = {row.name: outcome(row, all_runs[row.engine]) for row in ROWS}
    DOC.write_text(render(outcomes))
    print(f"wrote {DOC} in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
