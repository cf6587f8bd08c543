"""The kvcomp connector's lifecycle against vLLM's real scheduler, without a model
(:mod:`tests.helpers.step_harness`), with synchronous and asynchronous scheduling.

Every step the harness's runner reads back each scheduled request's KV as the worker reads it and
asserts it holds the positions the worker kept, with the request's own tokens, in blocks the pool
has not freed; these tests add what each lifecycle must end with: every block back in the pool,
no state left on either half of the connector.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.helpers.step_harness import StepHarness
from vllm_kvcomp.policies.registry import POLICY_NAMES, get_policy_class, streaming_policy_names

pytestmark = pytest.mark.vllm  # vLLM's scheduler (no engine, no model)

BS = 32
PROMPT = 600  # 18 full blocks and 24 tokens: 19 blocks
#: applied where a policy takes the setting: ratio 0.25; razor's recent buffer and lagkv's lag below
#: the prompt (their defaults keep it whole); decode recompression every 4 steps once due
SETTINGS = {"ratio": 0.25, "buffer": 64, "lag": 16, "interval": 4}
#: scheduling, and where compressions are decided: inside the step (lag 0), or off it and packed
#: at the 2nd bind after their launch (deterministic, :mod:`vllm_kvcomp.engine.offload`)
MODES = ["sync", "async", "sync-lag2", "async-lag2"]


def spec_for(policy: str, **more) -> dict:
    accepted = get_policy_class(policy).accepted_params()
    return {**{k: v for k, v in SETTINGS.items() if k in accepted}, **more}


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture
def make(tiny_model_dir, mode):
    """``make(**harness_options)``: a fresh harness on the tiny model (profiles for razor / pod)."""
    lag = int(mode.partition("-lag")[2] or 0)
    return lambda **kw: StepHarness(tiny_model_dir, async_scheduling=mode.startswith("async"),
                                    **{"compression_lag": lag, **kw})


def assert_clean(h: StepHarness) -> None:
    h.run_until_idle()
    assert h.leaks() == []
    assert h.worker.requests == {} and h.sched.requests == {}


def kept_blocks(h: StepHarness, rid: str) -> int:
    """Blocks the packed pages fill (engine/pages.py: ``ceil(sum m / (L * H))``)."""
    pages = h.pages(rid)
    return math.ceil(int(pages.counts.sum()) / pages.geometry.pages_per_block)


def settled(rid: str):
    """Condition: ``rid`` compressed and the scheduler freed what the compaction emptied."""
    return lambda h: h.compressed(rid) and h.blocks_held(rid) < len(h.scheduler.kv_cache_manager.get_block_ids(rid)[0])


def test_decode_updates_page_tables_in_place(make):
    """The compressed rows' page tables (what every layer's kernel call reads) stay on the device
    between decode steps: a tail entering a block writes its new pages there (the harness checks
    the tables every step), and they are rebuilt from the host only when the rows change."""
    h = make()
    for rid, seed in (("a", 3), ("b", 4)):
        h.add(rid, ids(PROMPT, seed), "snapkv", max_tokens=3 * BS, **spec_for("snapkv"))
    h.step_until(lambda h: settled("a")(h) and settled("b")(h))
    h.step()
    rebuilds, sends = h.worker.tables.rebuilds, h.worker.staging.sends
    for _ in range(2 * BS):
        h.step()
    assert h.worker.tables.rebuilds == rebuilds  # two tails entered new blocks: written in place
    assert h.worker.staging.sends == sends + 2 * BS  # one transfer a step
    assert_clean(h)


# ---------------------------------------------------------------------------- every policy
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_completes_and_returns_everything(make, policy):
    """prompt -> prompt-end compression -> decode (with recompressions where the policy does)
    -> finish: every block back, the scheduler half forgets at once, the worker at the next step."""
    h = make()
    h.add("r", ids(PROMPT, 1), policy, max_tokens=48, **spec_for(policy))
    h.step_until(lambda h: "r" in h.results)
    assert len(h.outputs["r"]) == 48
    assert "r" not in h.sched.requests
    h.step()
    assert h.worker.requests == {}
    assert_clean(h)
    stats = (h.results["r"] or {}).get("kvcomp")
    if policy == "full":
        assert stats is None  # never tracked
        return
    assert stats["blocks_freed"] > 0 and stats["compressions"] >= 1, stats
    if get_policy_class(policy).RECOMPRESSES:
        assert stats["compressions"] >= 2, stats  # 48 decode steps pass a page over the budget


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p != "full"])
def test_blocks_held_after_compression_are_the_kept_pages_plus_the_tail(make, policy, prefix_caching):
    """Once the scheduler applied the compaction's report, the request's table holds what
    engine/pages.py says: the blocks its packed pages fill, then its tail (with prefix caching the
    packed blocks are the spares that replaced its prompt blocks)."""
    h = make(prefix_caching=prefix_caching)
    h.add("r", ids(PROMPT, 2), policy, max_tokens=8, **spec_for(policy))
    h.step_until(settled("r"))
    pages, table = h.pages("r"), h.scheduler.kv_cache_manager.get_block_ids("r")[0]
    tail = len(table) - pages.tail_col  # the block of the compression point and any after it
    assert h.blocks_held("r") == kept_blocks(h, "r") + tail
    assert kept_blocks(h, "r") < math.ceil(PROMPT / BS)
    assert_clean(h)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p != "full"])
def test_peak_blocks_during_compaction(make, policy, prefix_caching):
    """The issue's target: a request holds at most prompt + kept + 2 blocks while it compacts
    (copy-on-compress packs into spares while its prompt blocks are still held)."""
    h = make(prefix_caching=prefix_caching)
    h.add("r", ids(PROMPT, 3), policy, max_tokens=4, **spec_for(policy))
    h.step_until(lambda h: h.compressed("r"))
    kept = kept_blocks(h, "r")
    h.run_until_idle()
    prompt = math.ceil(PROMPT / BS)
    assert h.peak_in_use <= prompt + kept + 2, f"peak {h.peak_in_use} > {prompt} prompt + {kept} kept + 2"
    assert h.leaks() == []


# ---------------------------------------------------------------------------- aborts
def _prefill_started(h):
    req = h.request("t")
    return 0 < req.num_computed_tokens < req.num_prompt_tokens


def _compression_pending(h):
    req = h.request("t")
    return req.num_computed_tokens >= req.num_prompt_tokens and not h.compressed("t")


def _compressing(h):
    """Its compression is being decided off the step (lag > 0), the request decoding meanwhile."""
    state = h.worker.requests.get("t")
    return state is not None and state.pending is not None and len(h.outputs.get("t", ())) >= 2


ABORT_POINTS = {
    "waiting": lambda h: True,
    "mid-prefill": _prefill_started,
    "compression-pending": _compression_pending,
    "compressed": lambda h: h.compressed("t"),
    "mid-decode": lambda h: h.compressed("t") and len(h.outputs["t"]) >= 4,
}


def _abort_when(h: StepHarness, point: str, condition) -> None:
    """A compressed request aborted once ``condition`` holds, next to a plain one (chunked prefill
    of 128 tokens): everything comes back, the neighbour finishes untouched."""
    target = h.add("t", ids(PROMPT, 4), "snapkv", max_tokens=32, ratio=0.25, window=16)
    h.add("n", ids(200, 5), max_tokens=16)
    h.step_until(condition)
    if point == "waiting":
        assert target.num_computed_tokens == 0
    h.abort("t")
    assert "t" not in h.sched.requests
    h.run_until_idle()
    assert len(h.outputs["n"]) == 16
    assert_clean(h)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("point", list(ABORT_POINTS))
def test_abort_at_every_state(make, point, prefix_caching):
    _abort_when(make(max_num_batched_tokens=128, prefix_caching=prefix_caching), point, ABORT_POINTS[point])


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("mode", [m for m in MODES if "-lag" in m])
def test_abort_while_its_compression_is_decided_off_the_step(make, mode, prefix_caching):
    """COMPRESSING (a lag > 0 only): aborted while its decision is made, after two tokens."""
    _abort_when(make(max_num_batched_tokens=128, prefix_caching=prefix_caching), "compressing", _compressing)


def test_waiting_request_aborted_behind_a_full_pool(make):
    """Waiting because the pool is full (not merely not yet scheduled): aborted, it never ran."""
    h = make(num_blocks=24)
    h.add("big", ids(PROMPT, 6), "snapkv", max_tokens=8, ratio=0.25, window=16)
    h.add("t", ids(PROMPT, 7), "streamingllm", max_tokens=8, ratio=0.25)
    h.step_until(lambda h: h.compressed("big"))
    assert h.request("t").num_computed_tokens == 0
    h.abort("t")
    assert_clean(h)
    assert "t" not in h.runner.cache_hits and len(h.outputs["big"]) == 8


# ---------------------------------------------------------------------------- preemption
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_preemption_recomputes_recompresses_and_leaks_nothing(make, prefix_caching):
    """Six 10-block requests in a 44-block pool (half of them compressed, keeping 90%): decode
    growth preempts; each recompute rebuilds full KV and compresses again."""
    h = make(num_blocks=45, prefix_caching=prefix_caching)
    requests = {}
    for i in range(6):
        spec = {"policy": "snapkv", "ratio": 0.9, "window": 16} if i % 2 else {}
        requests[f"r{i}"] = h.add(f"r{i}", ids(316, 10 + i), max_tokens=40, **spec)
    h.run_until_idle()
    assert all(len(h.outputs[rid]) == 40 for rid in requests)
    assert sum(r.num_preemptions for r in requests.values()) > 0, "the pool was not small enough to preempt"
    preempted = [h.results[rid]["kvcomp"] for rid in requests if int(rid[1:]) % 2
                 and h.results[rid]["kvcomp"]["preemptions"]]
    assert preempted, "no compressed request was preempted"
    for stats in preempted:  # once per admission, unless preempted before its compression ran
        assert 1 <= stats["compressions"] <= stats["preemptions"] + 1, stats
    assert h.leaks() == []


# ---------------------------------------------------------------------------- prefix caching
@pytest.mark.parametrize("abort_first", [False, True], ids=["complete", "abort-first"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_two_requests_sharing_a_prefix(make, prefix_caching, abort_first):
    """A compressed request caches a 320-token prefix; a second compressed request and a plain
    one read it (copy-on-compress: the first compaction packs into spares and leaves the shared
    blocks as they were, which every later read of them checks)."""
    h = make(prefix_caching=prefix_caching)
    prefix = ids(320, 8)
    h.add("a", prefix + ids(64, 9), "snapkv", max_tokens=24, ratio=0.25, window=16)
    h.step_until(lambda h: h.compressed("a"))
    h.add("b", prefix + ids(64, 10), "snapkv", max_tokens=24, ratio=0.25, window=16)
    h.add("c", prefix + ids(40, 11), max_tokens=24)
    h.step_until(lambda h: h.compressed("b"))
    if abort_first:
        h.abort("a")
    h.run_until_idle()
    expected_hit = 320 if prefix_caching else 0
    assert h.runner.cache_hits["b"] == h.runner.cache_hits["c"] == expected_hit
    assert len(h.outputs["b"]) == len(h.outputs["c"]) == 24
    assert h.results["b"]["kvcomp"]["blocks_freed"] > 0
    assert_clean(h)


# ---------------------------------------------------------------------------- prefill=stream
def _stream_params():
    return [pytest.param(mode, policy, id=f"{mode}-{policy}") for mode in MODES for policy in streaming_policy_names()]


@pytest.mark.parametrize(("mode", "policy"), list(_stream_params()))
def test_prefill_stream_compresses_every_chunk_and_stays_bounded(make, mode, policy):
    """Compressed after every 128-token chunk of a 900-token prompt: the request holds at most
    what the scheduler admits it by (``streaming_bound`` + one chunk — two under async
    scheduling, where chunk k+1 is allocated before chunk k's report frees anything — + two
    pages), always less than its prompt."""
    prompt, chunk = 900, 128
    h = make(max_num_batched_tokens=chunk)
    spec = spec_for(policy, prefill="stream")
    h.add("s", ids(prompt, 12), policy, max_tokens=16, **spec)
    h.run_until_idle()
    stats = h.results["s"]["kvcomp"]
    assert len(h.outputs["s"]) == 16 and stats["compressions"] >= 3, stats
    assert h.leaks() == []
    assert h.peak_in_use < math.ceil(prompt / BS)
    bound = get_policy_class(policy).from_settings(spec).streaming_bound(prompt)
    if bound is not None:  # razor's depends on its profile
        promised = math.ceil((bound + (2 if mode.startswith("async") else 1) * chunk + 2 * BS) / BS)
        assert h.peak_in_use <= promised, f"peak {h.peak_in_use} blocks > {promised} (bound {bound} tokens)"


def _stream_cache_params():
    return [pytest.param(mode, policy, order, id=f"{mode}-{policy}-{order}") for mode in MODES
            for policy in streaming_policy_names() for order in ("stream-first", "plain-first")]


@pytest.mark.parametrize(("mode", "policy", "order"), list(_stream_cache_params()))
def test_prefill_stream_request_stays_out_of_the_prefix_cache(make, mode, policy, order):
    """A prefill=stream request rewrites its prompt blocks chunk by chunk, so it is salted out of
    the prefix cache (docs/engine.md): a plain request after it with the same 320-token prefix
    finds nothing cached, and one running before it keeps reading its own prefix."""
    h = make(prefix_caching=True, max_num_batched_tokens=128)
    prefix = ids(320, 15)
    if order == "plain-first":
        h.add("plain", prefix + ids(100, 16), max_tokens=40)
        h.step_until(lambda h: len(h.outputs["plain"]) >= 1)
    h.add("s", prefix + ids(280, 17), policy, max_tokens=4, **spec_for(policy, prefill="stream"))
    h.step_until(lambda h: "s" in h.results)
    if order == "stream-first":
        h.add("plain", prefix + ids(100, 16), max_tokens=8)
    h.run_until_idle()  # the runner's KV check raises if "plain" reads what "s" compacted
    assert h.runner.cache_hits["s"] == 0 and h.runner.cache_hits["plain"] == 0
    assert h.leaks() == []


# ---------------------------------------------------------------------------- a mixed batch
@pytest.mark.parametrize("paged_cache", ["cuda", "cpu"], ids=["CudaPagedCache", "CpuPagedCache"])
def test_mixed_batch_of_every_policy(make, paged_cache):
    """Every policy and a plain request in one batch, prompts of different residues, decode
    recompressions; on both page-cache classes (the CPU one attends with vLLM's CPU kernel)."""
    h = make(num_blocks=128, paged_cache=paged_cache, max_num_batched_tokens=1024)
    for i, policy in enumerate(POLICY_NAMES):
        h.add(policy, ids(300 + 37 * i, 20 + i), policy, max_tokens=40, **spec_for(policy))
    h.add("plain", ids(333, 40), max_tokens=40)
    h.run_until_idle()
    assert all(len(tokens) == 40 for tokens in h.outputs.values())
    for policy in POLICY_NAMES[1:]:
        assert h.results[policy]["kvcomp"]["blocks_freed"] > 0, (policy, h.results[policy])
    assert h.leaks() == []


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_policy_packed_when_its_decision_is_ready(make, mode, prefix_caching):
    """``compression_lag`` auto (the default): each compression is decided on the side thread
    while its request decodes and packed at the first bind after it is made, whenever that is;
    every step's KV check holds, every request completes, nothing leaks."""
    h = make(num_blocks=160, max_num_batched_tokens=1024, prefix_caching=prefix_caching, compression_lag=None)
    events = []
    h.worker.listeners.append(events.append)
    for i, policy in enumerate(POLICY_NAMES[1:]):
        h.add(policy, ids(300 + 37 * i, 60 + i), policy, max_tokens=40, **spec_for(policy))
    h.add("plain", ids(333, 80), max_tokens=40)
    h.run_until_idle()
    assert all(len(tokens) == 40 for tokens in h.outputs.values())
    assert events and all(e.switched >= e.num_tokens for e in events)
    assert h.leaks() == [] and h.worker.in_flight == 0


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_random_traffic(make, prefix_caching):
    """Requests of every policy (some streaming, some sharing a prefix) arrive and are aborted at
    random into a small pool with chunked prefill: every step's KV check holds, nothing leaks."""
    rng = random.Random(0)
    h = make(num_blocks=28, max_num_batched_tokens=rng.choice([64, 128, 256]), max_num_seqs=6,
             prefix_caching=prefix_caching)
    prefixes = [ids(n, 100 + n) for n in (64, 200, 320)]
    # not razor with prefill=stream: test_prefill_stream_request_stays_out_of_the_prefix_cache
    streamable = [p for p in streaming_policy_names()
                  if get_policy_class(p).from_settings(spec_for(p)).streaming_bound(600) is not None]
    for step in range(160):
        if rng.random() < 0.2:
            policy = rng.choice([*POLICY_NAMES, None])
            spec = spec_for(policy) if policy else {}
            if policy in streamable and rng.random() < 0.4:
                spec["prefill"] = "stream"
            prompt = (rng.choice(prefixes) if rng.random() < 0.5 else []) + ids(rng.randrange(20, 300), step)
            h.add(f"q{step}", prompt, policy, max_tokens=rng.randrange(1, 40), **spec)
        if rng.random() < 0.05 and h.added:
            h.abort(rng.choice(sorted(h.added)))
        if h.busy:
            h.step()
    h.run_until_idle()
    assert h.leaks() == []
    stats = [r["kvcomp"] for r in h.results.values() if r and "kvcomp" in r]
    assert len(h.added) > 20 and sum(s["compressions"] for s in stats) > 10, stats


# ---------------------------------------------------------------------------- the harness can fail
def test_kv_check_catches_a_corrupted_kept_cell(make):
    h = make()
    h.add("r", ids(PROMPT, 13), "streamingllm", max_tokens=8, ratio=0.25)
    h.step_until(lambda h: h.compressed("r"))
    pages = h.pages("r")
    page = pages.packed[1, 0, 0:1]  # layer 1, head 0: its first packed page, first cell
    keys, values = h.worker.cache.read_cells(page, torch.tensor([0]))
    values[:, 1] += 1  # another token
    h.worker.cache.write_cells(page, torch.tensor([0]), keys, values)
    with pytest.raises(AssertionError, match="wrong tokens"):
        h.step()


def test_leaks_names_what_is_left(make):
    h = make()
    h.add("r", ids(100, 14), "streamingllm", max_tokens=2, ratio=0.25)
    h.run_until_idle()
    assert h.leaks() == []
    h.worker.requests["r"] = object()
    block = h.pool.get_new_blocks(1)
    assert len(h.leaks()) == 3, h.leaks()  # free count, the referenced block, the worker's entry
    h.pool.free_blocks(block)


def test_a_query_window_no_later_decision_reads_is_given_back(make):
    """A request's query window lies outside engine/memory.py's bound: once compressed at its
    prompt's end, a policy whose decisions read no queries again (snapkv) gives its rows back;
    one that recompresses over the cache (snapkv decode=recompress) keeps capturing."""
    h = make()
    h.add("once", ids(PROMPT, 5), "snapkv", max_tokens=3 * BS, **spec_for("snapkv"))
    h.add("again", ids(PROMPT, 6), "snapkv", max_tokens=3 * BS, **spec_for("snapkv", decode="recompress"))
    h.step_until(lambda h: h.compressed("once") and h.compressed("again"))
    h.step()
    windows = {rid: h.worker.requests[rid].window for rid in ("once", "again")}
    assert windows["once"]._buffer is None and windows["once"].queries is None
    assert windows["again"].queries is not None and windows["again"].queries.shape[0] == windows["again"].size
    assert_clean(h)


def test_a_decision_reads_the_request_one_layer_at_a_time(make, monkeypatch):
    """What engine/memory.py bounds: a compression reads one layer's pages at a time ([H, W]
    tables, never [L, H, W]), each layer once for a policy that scores each layer once."""
    from vllm_kvcomp.engine import cache as paged

    tables = []
    for cls in (paged.CpuPagedCache, paged.CudaPagedCache):
        monkeypatch.setattr(cls, "read_pages", lambda self, pages, *a, read=cls.read_pages, **k:
                            tables.append(tuple(pages.shape)) or read(self, pages, *a, **k))
    h = make()
    h.add("a", ids(PROMPT, 5), "snapkv", max_tokens=4, **spec_for("snapkv"))
    assert_clean(h)
    if h.worker.offload is not None:
        h.worker.offload.close(wait=True)
    heads = h.worker.num_kv_heads
    assert len(tables) == h.worker.num_layers and all(len(t) == 2 and t[0] == heads for t in tables)


@pytest.mark.parametrize("paged_cache", ["cpu", "cuda"])
def test_h2o_decode_recompressions_read_observed_attention(make, monkeypatch, paged_cache):
    """Both caches' decode kernels (kvcomp's C kernel; on the CUDA path the Triton kernel, here its
    torch reference) sum the attention H2O accumulates as they attend every decode row: a decode
    recompression reads no page back and scores no window."""
    from vllm_kvcomp.engine import cache as paged
    from vllm_kvcomp.engine.worker import KVCompWorker
    from vllm_kvcomp.kernels import cpu_native
    from vllm_kvcomp.policies.h2o import H2O

    if paged_cache == "cpu" and cpu_native.library() is None:
        pytest.skip("no C compiler to build the kernel")
    reads, decodes, observed, decided = [], [], [], []
    compress, decide = KVCompWorker._compress, KVCompWorker.decide
    read_pages = {cls: cls.read_pages for cls in (paged.CpuPagedCache, paged.CudaPagedCache)}
    add_window = H2O._add_window

    def tracked(self, rid, state, sched, end, decode):
        decodes.append(decode)
        return compress(self, rid, state, sched, end, decode)

    for cls, read in read_pages.items():
        monkeypatch.setattr(cls, "read_pages", lambda self, *a, read=read, **k: reads.append(decodes[-1]) or read(self, *a, **k))
    monkeypatch.setattr(KVCompWorker, "_compress", tracked)
    monkeypatch.setattr(KVCompWorker, "decide", lambda self, *a, **k: decided.append(a[3]) or decide(self, *a, **k))
    monkeypatch.setattr(H2O, "_add_window", staticmethod(
        lambda kv, memory, acc: observed.append(kv.observed is not None) or add_window(kv, memory, acc)))
    h = make(paged_cache=paged_cache)
    h.add("a", ids(PROMPT, 5), "h2o", max_tokens=2 * BS, **spec_for("h2o"))
    assert_clean(h)
    if h.worker.offload is not None:  # a decision launched late may still run (or never start)
        h.worker.offload.close(wait=True)
    assert decodes.count(True) >= 2 and decided.count(True) >= 1 and decodes[0] is False  # the last may be dropped
    decode_reads = reads.count(True)
    layers = h.worker.num_layers
    assert decode_reads == 0 and observed[:layers] == [False] * layers
    assert all(observed[layers:]) and len(observed) == layers * len(decided)
