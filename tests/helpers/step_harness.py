"""A vLLM-free step harness for the kvcomp connector: vLLM's real scheduler, a fake model.

In the spirit of vLLM's ``RequestRunner`` (its offloading-connector tests), :class:`StepHarness`
runs the engine loop by hand, one step at a time, with no engine process and no model forward.

**Real**: vLLM's ``Scheduler`` (``AsyncScheduler`` with ``async_scheduling=True``, driven through
a two-deep batch queue as ``EngineCore.step_with_batch_queue`` drives it), its
``KVCacheManager`` and ``BlockPool`` (prefix caching, chunked prefill, preemption, frees);
the kvcomp connector's scheduler half, built by vLLM from ``kv_transfer_config()`` after
``vllm_kvcomp.register()``; the kvcomp worker half (:class:`~vllm_kvcomp.engine.worker.KVCompWorker`,
its policies, packed pages and compaction) over an in-memory LBHNC KV buffer paged by
``CudaPagedCache`` (torch path, CPU tensors) or ``CpuPagedCache`` (vLLM's CPU kernel).

**Fake** (:class:`FakeRunner`, what vLLM's model runner would do): block tables kept per request
from the scheduler output, each scheduled token's K/V written to its slot, then per layer the
worker's ``after_attention`` hook with random queries (no attention of our own: outputs are
zeros except the rows the worker attends itself), ``finish_step`` / ``take_report`` /
``clear_step``, and a ``ModelRunnerOutput`` whose sampled tokens are one fixed id and whose
``kv_connector_output`` carries the worker's ``WorkerReport``. K/V are a deterministic function of
(token, position, layer, head) — so prefix-cache hits find the same bytes a real model would
have written — and every value vector starts with ``(position, token)``.

That makes the KV **checkable**: after every step the runner reads back each scheduled request's
cache the way the worker reads it (its virtual sequences over packed pages, or vLLM's natural
layout) and asserts it holds exactly the positions the worker claims, with the request's own
tokens, in blocks the pool has not freed (:meth:`FakeRunner.check_kv`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SAMPLED_TOKEN = 7  # every sampled token (no model: the id never matters to the KV cache's bookkeeping)


def spec_args(policy: str | None, **settings: Any) -> dict[str, Any] | None:
    """``SamplingParams.extra_args`` for a spec (flat ``kvcomp_*`` keys); None: no compression."""
    if policy is None:
        return None
    return {f"kvcomp_{key}": value for key, value in {"policy": policy, **settings}.items()}


def _layer_kv(tokens: torch.Tensor, positions: torch.Tensor, layer: int, heads: int, dim: int):
    """K, V [T, H, D] of tokens at positions: deterministic, as a model's cache would be for a
    given prefix; V[..., 0] = position, V[..., 1] = token (what :meth:`FakeRunner.check_kv` reads)."""
    x = (tokens.double() * 0.6180339 + positions.double() * 0.0137 + layer * 0.291).view(-1, 1, 1)
    h = torch.arange(heads, dtype=torch.float64).view(1, -1, 1)
    d = torch.arange(1, dim + 1, dtype=torch.float64).view(1, 1, -1)
    keys = torch.sin(x * d + 1.7 * h) * 2.0
    values = torch.cos(x * d * 0.77 + 0.9 * h)
    values[..., 0] = positions.double().view(-1, 1)
    values[..., 1] = tokens.double().view(-1, 1)
    return keys.float(), values.float()


@dataclass
class RunnerRequest:
    """What a model runner keeps per request: its prompt, its (append-only) block table and the
    number of tokens it knows (prompt + outputs, placeholders included under async scheduling)."""

    prompt: torch.Tensor
    blocks: list[int]
    num_tokens: int

    def tokens(self, positions: torch.Tensor) -> torch.Tensor:
        """Token ids at ``positions``: the prompt's, then the one sampled id."""
        inside = positions < len(self.prompt)
        return torch.where(inside, self.prompt[positions.clamp(max=len(self.prompt) - 1)], SAMPLED_TOKEN)


class FakeRunner:
    """vLLM's model runner minus the model: executes one ``SchedulerOutput`` on the worker."""

    def __init__(self, worker, layer_names: list[str], num_heads: int, pool, seed: int = 0, check: bool = True):
        self.worker = worker
        self.layer_names = layer_names
        self.num_heads = num_heads
        self.pool = pool  # vLLM's BlockPool: the KV check asserts pages it reads are not free
        self.check = check
        self.requests: dict[str, RunnerRequest] = {}
        self.cache_hits: dict[str, int] = {}  # tokens each request found in the prefix cache
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0

    @property
    def cache(self):
        return self.worker.cache

    def execute(self, out) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        assert not out.kv_cache_block_copies, "block copies (mamba CoW) are not simulated"
        computed = self._update_states(out)
        self.worker.bind(out.kv_connector_metadata)
        rows = list(out.num_scheduled_tokens.items())
        self.worker.set_batch([rid for rid, _ in rows], out.num_scheduled_tokens)  # as the model runner tells it
        if rows:
            self._forward(rows, computed)
            if self.check:
                self.check_tables()
        self.worker.finish_step()
        if self.check:
            for rid, n in rows:
                self.check_kv(rid, computed[rid] + n)
        report = self.worker.take_report()
        self.worker.clear_step()
        self.steps += 1
        sampled = [[SAMPLED_TOKEN] if computed[rid] + n >= self.requests[rid].num_tokens else [] for rid, n in rows]
        return ModelRunnerOutput(
            req_ids=[rid for rid, _ in rows], req_id_to_index={rid: i for i, (rid, _) in enumerate(rows)},
            sampled_token_ids=sampled, kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=report))

    def _update_states(self, out) -> dict[str, int]:
        """Block tables and token counts as ``GPUModelRunner._update_states`` keeps them."""
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        computed = {}
        for new in out.scheduled_new_reqs:
            prompt = torch.tensor(new.prompt_token_ids)
            self.requests[new.req_id] = RunnerRequest(prompt, list(new.block_ids[0]), len(prompt))
            computed[new.req_id] = self.cache_hits[new.req_id] = new.num_computed_tokens  # a prefix-cache hit
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            req, new_ids = self.requests[rid], cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and back: a new table
                req.blocks = list(new_ids[0])
            elif new_ids is not None:
                req.blocks.extend(new_ids[0])
            req.num_tokens = len(req.prompt) + cached.num_output_tokens[i]
            computed[rid] = cached.num_computed_tokens[i]
        return computed

    def _forward(self, rows: list[tuple[str, int]], computed: dict[str, int]) -> None:
        bs = self.worker.block_size
        positions, tokens, slots = [], [], []
        for rid, n in rows:
            req = self.requests[rid]
            pos = torch.arange(computed[rid], computed[rid] + n)
            positions.append(pos)
            tokens.append(req.tokens(pos))
            slots.append(torch.tensor(req.blocks)[pos // bs] * bs + pos % bs)
        positions, tokens, slots = torch.cat(positions), torch.cat(tokens), torch.cat(slots)
        geometry, heads, dim = self.cache.geometry, self.cache.geometry.num_kv_heads, self.cache.head_dim
        pages = geometry.page_ids(slots // bs)  # [L, H, T]
        offsets = (slots % bs).view(-1, 1).expand(-1, heads).reshape(-1)
        for layer, name in enumerate(self.layer_names):
            keys, values = _layer_kv(tokens, positions, layer, heads, dim)
            self.cache.write_cells(pages[layer].T.reshape(-1), offsets, keys.reshape(-1, dim),
                                   values.reshape(-1, dim))
            query = torch.randn(len(tokens), self.num_heads, dim, generator=self.generator)
            output = torch.zeros_like(query)
            self.worker.after_attention(name, query, output)

    def check_tables(self) -> None:
        """The page tables every layer's kernel read this step (kept on the device between
        steps, updated in place) are the requests' own tables (:meth:`RequestPages.tables`)."""
        plan = self.worker._plan
        if plan is None or not plan.batch.requests:
            return
        want = [(state.pages.tables(self.worker.step[row.req_id].block_ids,
                                    self.worker.step[row.req_id].num_computed + self.worker.step[row.req_id].num_scheduled))
                for row, state in zip([r for r in plan.rows if self.worker.requests[r.req_id].compressed],
                                      plan.batch.requests)]
        got, s = plan.batch.tables, 0
        for table in want:
            heads, width = table.shape[1], table.shape[2]
            assert torch.equal(got[:, s : s + heads, :width].long(), table), "device page tables differ from the requests'"
            s += heads
        assert s == got.shape[1]

    def check_kv(self, rid: str, end: int) -> None:
        """Read ``rid``'s cache as the worker reads it (virtual sequences of a compressed request,
        else vLLM's layout): every (layer, head) holds the positions the worker says it kept
        (:meth:`RequestPages.positions`), with the request's own tokens, in live blocks."""
        req, state = self.requests[rid], self.worker.requests.get(rid)
        geometry, bs = self.cache.geometry, self.worker.block_size
        if state is not None:
            tables = state.pages.tables(torch.tensor(req.blocks), end)
            want = [row[row >= 0] for row in state.pages.positions(end).flatten(0, 1)]
        else:  # vLLM's layout: every head holds 0..end-1
            tables = geometry.page_ids(torch.tensor(req.blocks[: math.ceil(end / bs)]))
            want = [torch.arange(end)] * (geometry.num_layers * geometry.num_kv_heads)
        want = torch.nn.utils.rnn.pad_sequence(want, batch_first=True, padding_value=-1)  # [L*H, N]
        cells = torch.arange(want.shape[1]).expand_as(want)
        valid = want >= 0
        pages = tables.flatten(0, 1).gather(1, cells // bs)[valid]
        region = (pages.unsqueeze(1) >= geometry.first_page).sum(1) - 1  # packed pages: any layer's cells
        blocks = ((pages - geometry.first_page[region]) // geometry.num_kv_heads).unique().tolist()
        dead = [b for b in blocks if b == 0 or self.pool.blocks[b].ref_cnt == 0]
        assert not dead, f"{rid} reads freed blocks {dead}"
        _, values = self.cache.read_cells(pages, cells[valid] % bs)
        got = torch.full_like(want, -1)
        got[valid] = values[:, 0].round().long()
        assert torch.equal(got, want), f"{rid}: (layer, head) {_first_mismatch(got, want)} holds other positions"
        tokens = req.tokens(want[valid])
        assert torch.equal(values[:, 1].round().long(), tokens), f"{rid}: wrong tokens"


def _first_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    row = int((got != want).any(1).nonzero()[0])
    cols = (got[row] != want[row]).nonzero().flatten()[:8].tolist()
    return f"row {row}: at {cols} {got[row, cols].tolist()} != {want[row, cols].tolist()}"


@dataclass
class StepHarness:
    """vLLM's scheduler + the kvcomp connector + :class:`FakeRunner`, stepped by hand.

    ``add`` / ``abort`` requests, ``step`` (one ``EngineCore.step`` or ``step_with_batch_queue``),
    ``run_until_idle``; read the pool (``free_blocks``, ``blocks_in_use``, ``peak_in_use``), a
    request's table (``blocks_held``) and both connector halves (``sched``, ``worker``).
    """

    model_dir: Path
    num_blocks: int = 64  # including vLLM's null block
    block_size: int = 32
    max_num_batched_tokens: int = 2048  # the prefill chunk
    max_num_seqs: int = 8
    max_model_len: int = 4096
    prefix_caching: bool = False
    async_scheduling: bool = False
    paged_cache: str = "cuda"  # "cuda": CudaPagedCache on CPU tensors; "cpu": CpuPagedCache (vLLM's kernel)
    profiles: dict[str, str] | None = None
    verify_kv: bool = True  # the runner checks every scheduled request's KV after each step
    seed: int = 0
    #: the worker's ``compression_lag`` (:mod:`vllm_kvcomp.engine.offload`): 0 inside the step,
    #: k > 0 off it and packed at the k-th bind after (deterministic), None when ready
    compression_lag: int | None = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)  # request id -> generated tokens
    results: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # finished: kv_transfer_params
    peak_in_use: int = 0

    def __post_init__(self) -> None:
        import vllm_kvcomp

        vllm_kvcomp.register()
        self.vllm_config = self._vllm_config()
        self.scheduler = self._scheduler()
        self.worker, layer_names, num_heads = self._worker()
        self.runner = FakeRunner(self.worker, layer_names, num_heads, self.pool, self.seed, self.verify_kv)
        self.initial_free = self.free_blocks
        self.batch_queue: deque = deque()
        self.added: set[str] = set()
        self._hasher = self._block_hasher()

    # ------------------------------------------------------------------ construction
    def _vllm_config(self):
        from vllm.engine.arg_utils import EngineArgs

        from vllm_kvcomp.engine.plugin import kv_transfer_config

        config = EngineArgs(
            model=str(self.model_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
            block_size=self.block_size, max_model_len=self.max_model_len, seed=self.seed,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            enable_prefix_caching=self.prefix_caching, kv_transfer_config=kv_transfer_config(self.profiles),
        ).create_engine_config()
        config.cache_config.num_gpu_blocks = self.num_blocks
        # the CPU platform turns async scheduling off; the scheduler half runs the same either way
        config.scheduler_config.async_scheduling = self.async_scheduling
        return config

    def _kv_cache_config(self):
        """One full-attention group over every layer, ``num_blocks`` blocks (by hand: no memory
        profiling, no tensors; the runner owns the buffer)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        model, parallel = self.vllm_config.model_config, self.vllm_config.parallel_config
        spec = FullAttentionSpec(block_size=self.block_size, num_kv_heads=model.get_num_kv_heads(parallel),
                                 head_size=model.get_head_size(), dtype=torch.float32)
        return KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(self.layer_names, spec)])

    @property
    def layer_names(self) -> list[str]:
        layers = self.vllm_config.model_config.get_num_layers(self.vllm_config.parallel_config)
        return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]

    def _scheduler(self):
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        cls = AsyncScheduler if self.async_scheduling else Scheduler
        return cls(vllm_config=self.vllm_config, kv_cache_config=self._kv_cache_config(),
                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                   block_size=self.block_size, hash_block_size=self.block_size)

    def _worker(self):
        from vllm_kvcomp.engine.cache import CpuPagedCache, CudaPagedCache
        from vllm_kvcomp.engine.policy_factory import PolicyFactory
        from vllm_kvcomp.engine.worker import KVCompWorker

        model, parallel = self.vllm_config.model_config, self.vllm_config.parallel_config
        heads, dim = model.get_num_kv_heads(parallel), model.get_head_size()
        names = self.layer_names
        # vLLM's allocation with layout LBHNC: one buffer, a [num_blocks, H, bs, 2D] view per layer
        buffer = torch.zeros(len(names), self.num_blocks, heads, self.block_size, 2 * dim)
        factory = PolicyFactory(str(self.model_dir), self.profiles)  # loads razor / pod profiles
        worker = KVCompWorker(block_size=self.block_size, policy_builder=factory.build)
        if hasattr(worker, "configure_offload"):
            worker.configure_offload(self.compression_lag)
        cache_cls = CudaPagedCache if self.paged_cache == "cuda" else functools.partial(CpuPagedCache, isa="vec")
        caches, index = {name: buffer[i] for i, name in enumerate(names)}, {name: i for i, name in enumerate(names)}
        if "variants" in inspect.signature(worker.register).parameters:  # how each layer attends (scale, ...)
            from vllm_kvcomp.engine.cache import AttentionVariant

            variants = {name: AttentionVariant(dim**-0.5) for name in names}
            q_dim, gen = model.get_num_attention_heads(parallel) * dim, torch.Generator().manual_seed(self.seed)
            out_proj = {name: torch.randn(model.get_hidden_size(), q_dim, generator=gen) * q_dim**-0.5
                        for name in names}  # each layer's W_o, as the connector reads it (criticalkv)
            worker.register(caches, index, cache_cls, variants, len(names), out_proj)
        else:  # the hook took the scale per call before AttentionVariant
            worker.register(caches, index, cache_cls, len(names))
        return worker, names, model.get_num_attention_heads(parallel)

    def _block_hasher(self):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)  # as EngineCore does: a connector always hashes
        return get_request_block_hasher(self.block_size, hash_fn)

    # ------------------------------------------------------------------ requests
    def add(self, rid: str, prompt: list[int], policy: str | None = None, max_tokens: int = 8, **spec: Any):
        """Add a request (``policy`` and ``spec`` become ``kvcomp_*`` extra args); returns vLLM's Request."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=spec_args(policy, **spec))
        request = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
                          block_hasher=self._hasher)
        self.scheduler.add_request(request)
        self.added.add(rid)
        self.outputs.setdefault(rid, [])
        return request

    def abort(self, *rids: str) -> None:
        """What ``EngineCore.abort_requests`` does between steps."""
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(rids), RequestStatus.FINISHED_ABORTED)
        self._track()

    def request(self, rid: str):
        return self.scheduler.requests.get(rid)

    # ------------------------------------------------------------------ stepping
    @property
    def depth(self) -> int:
        return 2 if self.async_scheduling else 1

    def step(self) -> None:
        """One engine-core step: schedule and execute (the runner runs eagerly, in order); then,
        once ``depth`` steps are in flight or nothing else can be scheduled, process the oldest
        step's output. Tensors are tiny: one intra-op thread (on a loaded machine every parallel
        op would wait milliseconds for its second thread)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._step()
        finally:
            torch.set_num_threads(threads)

    def _step(self) -> None:
        if self.scheduler.has_requests():
            out = self.scheduler.schedule()
            self._track()
            self.batch_queue.appendleft((out, self.runner.execute(out)))
            executed = out.total_num_scheduled_tokens > 0
            if len(self.batch_queue) < self.depth and (executed or self.scheduler.has_requests()):
                return
        elif not self.batch_queue:
            return
        out, model_output = self.batch_queue.pop()
        for outputs in self.scheduler.update_from_output(out, model_output).values():
            for o in outputs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.results[o.request_id] = o.kv_transfer_params
        self._track()

    @property
    def busy(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def run_until_idle(self, max_steps: int = 2000) -> int:
        """Step until nothing is scheduled or in flight (the last steps tell the worker about
        finished requests); returns the steps taken."""
        for steps in range(max_steps):
            if not self.busy:
                return steps
            self.step()
        raise AssertionError(f"not idle after {max_steps} steps")

    def step_until(self, condition, max_steps: int = 500) -> int:
        """Step until ``condition(self)`` holds (checked before each step); returns the steps taken."""
        for steps in range(max_steps):
            if condition(self):
                return steps
            assert self.busy, "idle before the condition held"
            self.step()
        raise AssertionError(f"condition not reached in {max_steps} steps")

    # ------------------------------------------------------------------ state
    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    @property
    def free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    @property
    def blocks_in_use(self) -> int:
        """Blocks taken from the pool (tables, spares; cached free blocks count as free)."""
        return self.initial_free - self.free_blocks

    def _track(self) -> None:
        self.peak_in_use = max(self.peak_in_use, self.blocks_in_use)

    def blocks_held(self, rid: str) -> int:
        """Non-null entries of ``rid``'s block table (0 once it holds none)."""
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        return sum(1 for block in manager.req_to_blocks.get(rid, ()) if not block.is_null)

    @property
    def sched(self):
        """The connector's scheduler half (``KVCompScheduler``)."""
        return self.scheduler.connector.scheduler

    def compressed(self, rid: str) -> bool:
        """Whether the worker holds ``rid`` compressed (its heads read packed pages)."""
        state = self.worker.requests.get(rid)
        return state is not None and state.compressed

    def pages(self, rid: str):
        """The worker's :class:`~vllm_kvcomp.engine.pages.RequestPages` of ``rid``."""
        return self.worker.requests[rid].pages

    def leaks(self) -> list[str]:
        """What is left after every request finished: blocks not back in the pool, referenced
        blocks, and any attribute of either connector half still naming a request id."""
        found = []
        if self.free_blocks != self.initial_free:
            found.append(f"free blocks {self.free_blocks} != {self.initial_free}")
        held = [b.block_id for b in self.pool.blocks if not b.is_null and b.ref_cnt != 0]
        if held:
            found.append(f"blocks still referenced: {held}")
        for half, obj in (("scheduler half", self.sched), ("worker", self.worker)):
            for name, value in vars(obj).items():
                named = _request_ids_in(value) & self.added
                if named:
                    found.append(f"{half}.{name} still names {sorted(named)}")
        if self.scheduler.requests:
            found.append(f"vLLM scheduler still has {sorted(self.scheduler.requests)}")
        return found


def _request_ids_in(value: Any) -> set[str]:
    """Strings among a container's keys / values / items, or among those of a dataclass's fields
    (request ids, for :meth:`StepHarness.leaks`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return set().union(*(_request_ids_in(getattr(value, f.name)) for f in dataclasses.fields(value)))
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, list | set | tuple | deque):
        items = list(value)
    else:
        return set()
    return {item for item in items if isinstance(item, str)}
