"""One in-process vLLM engine (tiny random Llama, kvcomp enabled) shared by all engine tests.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni executor) so tests can read the
scheduler's block pool and both halves of the connector directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.tiny_llama import ENGINE_KV_CACHE_BYTES, make_tiny_llama, seeded_scorer

BLOCK_SIZE = 32
NUM_BLOCKS = 96  # a small pool: ~3K tokens, so preemption is easy to force
TINY = dict(num_layers=3, hidden_size=192, num_heads=6, num_kv_heads=2, head_dim=32,
            intermediate_size=256, vocab_size=512, seed=0)


@dataclass
class Engine:
    llm: object
    model_dir: Path

    @property
    def core(self):
        return self.llm.llm_engine.engine_core.engine_core

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    @property
    def free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    @property
    def sched_connector(self):
        return self.scheduler.connector.scheduler

    @property
    def worker_connector(self):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().worker


#: calibration profiles written next to the tiny model (razor: retrieval KV heads; pod: groups;
#: duoattention: gates [layer][KV head] whose retrieval heads, gate ≥ 0.5, are razor's; kvzap: a
#: seeded scorer)
RETRIEVAL_KV_HEADS = frozenset({(0, 1), (2, 0)})
POD_GROUPS = ((0, 1), (2,))
DUO_GATES = ((0.2, 0.9), (0.4, 0.0), (0.6, 0.1))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from vllm_kvcomp.calibration.profiles import (
        HeadGatesProfile,
        LayerGroupsProfile,
        ModelIdentity,
        RetrievalHeadsProfile,
        save_profile,
    )

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", **TINY)
    model = ModelIdentity.from_model_dir(path)
    save_profile(RetrievalHeadsProfile(model=model, kv_heads=RETRIEVAL_KV_HEADS), model_dir=path)
    save_profile(LayerGroupsProfile(model=model, groups=POD_GROUPS), model_dir=path)
    save_profile(HeadGatesProfile(model=model, gates=DUO_GATES), model_dir=path)
    save_profile(seeded_scorer(path), model_dir=path)
    return path


@pytest.fixture(scope="session")
def engine(tiny_model_dir) -> Engine:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from vllm_kvcomp.engine.plugin import kv_transfer_config

    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS,
        max_model_len=2048,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        kv_cache_memory_bytes=ENGINE_KV_CACHE_BYTES,
        # compressions inside the step: the oracle tests compare every step; off the step with a
        # fixed lag: test_oracle_equality's off-the-step test
        kv_transfer_config=kv_transfer_config(compression_lag=0),
        seed=0,
    )
    yield Engine(llm, tiny_model_dir)
    del llm


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic random prompt of ``n`` token ids (specials excluded)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, TINY["vocab_size"]) for _ in range(n)]


def params(max_tokens: int = 16, **spec):
    """Greedy SamplingParams with logprobs; ``spec`` becomes flat ``kvcomp_*`` extra args."""
    from vllm import SamplingParams

    extra = {f"kvcomp_{k}": v for k, v in spec.items()} or None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, extra_args=extra,
                          ignore_eos=True)


def generate(engine: Engine, prompts: list[list[int]], sps) -> list:
    """Run a batch to completion; one RequestOutput per prompt, in order."""
    if not isinstance(sps, list):
        sps = [sps] * len(prompts)
    return engine.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)


def token_logprobs(output) -> list[float]:
    """Logprob of each generated token of a RequestOutput."""
    completion = output.outputs[0]
    return [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs)]
