"""The oracle against plain HF generation and against an independent dense brute force."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from tests.helpers.tiny_llama import make_tiny_llama
from vllm_kvcomp import oracle
from vllm_kvcomp.policies.base import Compensation, LayerKV, Policy, RequestState, Selection
from vllm_kvcomp.policies.registry import get_policy_class

PROMPT = [1, 120, 118, 104, 117, 13, 107, 104, 111, 111, 114, 278, 107, 104, 117, 104, 2, 13, 1, 303,
          118, 108, 118, 119, 298, 119, 13]  # 27 tokens

# rule(layer, kv_head, live positions, compression index) -> positions to keep
Rule = Callable[[int, int, list[int], int], list[int]]


def keep_all(layer: int, head: int, positions: list[int], index: int) -> list[int]:
    return positions


def strided(layer: int, head: int, positions: list[int], index: int) -> list[int]:
    """Head h keeps every (h + 2 + layer)-th token and the last two: counts differ per head."""
    stride = head + 2 + layer
    return [p for p in positions if p % stride == 0 or p >= positions[-1] - 1]


def strided_then_all(layer: int, head: int, positions: list[int], index: int) -> list[int]:
    return strided(layer, head, positions, index) if index == 0 else positions


def sink_recent(budget: int) -> Rule:
    def rule(layer: int, head: int, positions: list[int], index: int) -> list[int]:
        return positions[:2] + positions[2:][-(budget - 2):]

    return rule


@dataclass
class RulePolicy(Policy):
    """Test policy: keeps the positions a rule picks; optional mean-of-dropped compensation."""

    name: ClassVar[str] = "test-rule"
    rule: Rule = keep_all
    compensate_until: int = 0  # compressions (counted from 0) that return a Compensation
    query_window: int = 0
    budget: int | None = None

    def queries_needed(self) -> int:
        return self.query_window

    def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
        if state.budget is None:
            state.budget = self.budget
        positions = kv.slot_positions()
        heads, dim = kv.num_kv_heads, kv.keys.shape[-1]
        k_hat, v_hat = torch.zeros(heads, dim), torch.zeros(heads, dim)
        counts = torch.zeros(heads)
        indices = []
        for h in range(heads):
            slots = torch.nonzero(positions[h] >= 0).flatten()
            live = positions[h, slots].tolist()
            keep = set(self.rule(kv.layer, h, live, state.compressions))
            chosen = torch.tensor([s for s, p in zip(slots.tolist(), live) if p in keep], dtype=torch.long)
            dropped = [s for s, p in zip(slots.tolist(), live) if p not in keep]
            indices.append(chosen)
            if dropped:
                k_hat[h] = kv.keys[h, dropped].mean(0)
                v_hat[h] = kv.values[h, dropped].mean(0)
                counts[h] = len(dropped)
        compensate = state.compressions < self.compensate_until
        return Selection(indices, Compensation(k_hat, v_hat, counts) if compensate else None)


@dataclass
class RecompressingRule(RulePolicy):
    name: ClassVar[str] = "test-recompressing"
    RECOMPRESSES: ClassVar[bool] = True
    interval: int | None = 1
    always: bool = False

    def due(self, state: RequestState, num_tokens: int, steps_since: int) -> bool:
        return True if self.always else super().due(state, num_tokens, steps_since)


# ---------------------------------------------------------------------------- brute force


def brute_force(model, prompt: list[int], max_new: int, rule: Rule, compress_after: set[int],
                compensate_until: int = 0, captured: dict[int, torch.Tensor] | None = None,
                ) -> tuple[list[int], list[float]]:
    """Dense reference: every token's K/V kept forever, an alive mask per (layer, head, position).

    Compression after forward s (0 = prefill) if s in ``compress_after``; the first
    ``compensate_until`` compressions replace the compensation token (mean of what they dropped).
    Attention in float64, the compensation token as one extra column of logit q·k̂·scale + ln N_d.
    ``captured`` receives each layer's post-RoPE prefill queries [H_q, P, D].
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg, inner = model.config, model.model
    layers, hkv, hq = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads
    dim, group = cfg.head_dim, hq // hkv
    scale = dim ** -0.5
    keys = [torch.zeros(hkv, 0, dim) for _ in range(layers)]
    values = [torch.zeros(hkv, 0, dim) for _ in range(layers)]
    alive = [torch.zeros(hkv, 0, dtype=torch.bool) for _ in range(layers)]
    comp: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * layers
    compressions = 0

    def forward(ids: list[int], start: int) -> torch.Tensor:
        t = len(ids)
        pos = torch.arange(start, start + t)
        x = inner.embed_tokens(torch.tensor(ids))
        cos, sin = inner.rotary_emb(x[None], pos[None])
        for i, layer in enumerate(inner.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = att.q_proj(h).view(t, hq, dim).transpose(0, 1)
            k = att.k_proj(h).view(t, hkv, dim).transpose(0, 1)
            v = att.v_proj(h).view(t, hkv, dim).transpose(0, 1)
            q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
            q, k = q[0], k[0]
            if captured is not None and start == 0:
                captured[i] = q.clone()
            keys[i] = torch.cat([keys[i], k], 1)
            values[i] = torch.cat([values[i], v], 1)
            alive[i] = torch.cat([alive[i], torch.ones(hkv, t, dtype=torch.bool)], 1)
            s = keys[i].shape[1]
            kk = keys[i].repeat_interleave(group, 0).double()
            vv = values[i].repeat_interleave(group, 0).double()
            logits = torch.einsum("htd,hsd->hts", q.double(), kk) * scale
            visible = alive[i].repeat_interleave(group, 0)[:, None, :] & (torch.arange(s)[None, None, :] <= pos[None, :, None])
            logits = logits.masked_fill(~visible, -math.inf)
            if comp[i] is not None:
                k_hat, v_hat, counts = (c.repeat_interleave(group, 0).double() for c in comp[i])
                extra = torch.einsum("htd,hd->ht", q.double(), k_hat) * scale + counts.log()[:, None]
                logits = torch.cat([logits, extra[..., None]], -1)
                vv = torch.cat([vv, v_hat[:, None, :]], 1)
            out = torch.softmax(logits, -1) @ vv  # [H_q, T, D]
            x = x + att.o_proj(out.transpose(0, 1).reshape(t, hq * dim).float())
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(inner.norm(x)[-1])

    def compress() -> None:
        for i in range(layers):
            k_hat, v_hat, counts = torch.zeros(hkv, dim), torch.zeros(hkv, dim), torch.zeros(hkv)
            for h in range(hkv):
                live = torch.nonzero(alive[i][h]).flatten().tolist()
                keep = set(rule(i, h, live, compressions))
                dropped = [p for p in live if p not in keep]
                alive[i][h, dropped] = False
                if dropped:
                    k_hat[h], v_hat[h] = keys[i][h, dropped].mean(0), values[i][h, dropped].mean(0)
                    counts[h] = len(dropped)
            if compressions < compensate_until:
                comp[i] = (k_hat, v_hat, counts)

    tokens, logprobs = [], []
    with torch.no_grad():
        ids, start = list(prompt), 0
        for step in range(max_new):
            logits = forward(ids, start)
            token = int(torch.argmax(logits))
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits.float(), -1)[token]))
            if step in compress_after:
                compress()
                compressions += 1
            start += len(ids)
            ids = [token]
    return tokens, logprobs


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: one intra-op thread is faster, and much faster on a shared, busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)



@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def model(tiny_dir):
    return oracle.load_model(tiny_dir)


def hf_greedy(path, attn: str, max_new: int) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attn).eval()
    ids = torch.tensor([PROMPT])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                       output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(PROMPT):].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_no_compression_reproduces_hf_generate(tiny_dir, model, attn):
    tokens, logprobs = hf_greedy(tiny_dir, attn, 12)
    for policy in (None, get_policy_class("full")()):
        result = oracle.generate(model, PROMPT, policy, 12)
        assert result.token_ids == tokens
        assert result.logprobs == pytest.approx(logprobs, abs=1e-5)
        assert result.compressions == []


def test_per_head_selection_with_compensation_matches_brute_force(model):
    result = oracle.generate(model, PROMPT, RulePolicy(rule=strided, compensate_until=1), 10)
    tokens, logprobs = brute_force(model, PROMPT, 10, strided, {0}, compensate_until=1)
    assert result.token_ids == tokens
    assert result.logprobs == pytest.approx(logprobs, abs=1e-4)
    (record,) = result.compressions
    live = list(range(len(PROMPT)))
    expected = [[len(strided(i, h, live, 0)) for h in range(2)] for i in range(2)]
    assert record["kept"] == expected
    assert len({c for layer in expected for c in layer}) > 1  # heads really differ
    assert record["evicted"] == 4 * len(PROMPT) - sum(map(sum, expected))
    assert record["step"] == 0 and record["num_tokens"] == len(PROMPT)
    # compression must matter on this model, or the comparison above proves nothing
    assert result.logprobs != pytest.approx(oracle.generate(model, PROMPT, None, 10).logprobs, abs=1e-3)


def test_selection_without_compensation_matches_brute_force(model):
    without = oracle.generate(model, PROMPT, RulePolicy(rule=strided), 6)
    tokens, logprobs = brute_force(model, PROMPT, 6, strided, {0})
    assert without.token_ids == tokens
    assert without.logprobs == pytest.approx(logprobs, abs=1e-4)
    with_comp = oracle.generate(model, PROMPT, RulePolicy(rule=strided, compensate_until=1), 6)
    assert with_comp.logprobs != pytest.approx(without.logprobs, abs=1e-4)


def test_decode_recompression_steps_and_counts(model):
    rule = sink_recent(8)
    result = oracle.generate(model, PROMPT, RecompressingRule(rule=rule, budget=8, interval=4), 14)
    steps = [c["step"] for c in result.compressions]
    assert steps == [0, 4, 8, 12]
    assert [c["num_tokens"] for c in result.compressions] == [27, 31, 35, 39]
    assert all(c["kept"] == [[8, 8], [8, 8]] for c in result.compressions)
    assert [c["evicted"] for c in result.compressions] == [4 * 19, 4 * 4, 4 * 4, 4 * 4]
    tokens, logprobs = brute_force(model, PROMPT, 14, rule, set(steps))
    assert result.token_ids == tokens
    assert result.logprobs == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("compensate_until", [1, 99])
def test_recompression_compensation_kept_or_replaced(model, compensate_until):
    """until=1: later compressions return None, the first compensation stays; 99: replaced each time."""
    rule = sink_recent(10)
    policy = RecompressingRule(rule=rule, budget=10, interval=3, compensate_until=compensate_until)
    result = oracle.generate(model, PROMPT, policy, 8)
    assert [c["step"] for c in result.compressions] == [0, 3, 6]
    tokens, logprobs = brute_force(model, PROMPT, 8, rule, {0, 3, 6}, compensate_until=compensate_until)
    assert result.token_ids == tokens
    assert result.logprobs == pytest.approx(logprobs, abs=1e-4)
    other = brute_force(model, PROMPT, 8, rule, {0, 3, 6}, compensate_until=100 - compensate_until)[1]
    assert result.logprobs != pytest.approx(other, abs=1e-4)


def test_keep_all_compaction_preserves_logical_positions(model):
    once = oracle.generate(model, PROMPT, RulePolicy(rule=strided), 10)
    every_step = oracle.generate(model, PROMPT, RecompressingRule(rule=strided_then_all, always=True), 10)
    assert len(every_step.compressions) == 10
    assert all(c["evicted"] == 0 for c in every_step.compressions[1:])
    assert every_step.token_ids == once.token_ids
    assert every_step.logprobs == pytest.approx(once.logprobs, abs=1e-6)
    plain = oracle.generate(model, PROMPT, None, 10)
    kept_all = oracle.generate(model, PROMPT, RecompressingRule(rule=keep_all, always=True), 10)
    assert kept_all.token_ids == plain.token_ids
    assert kept_all.logprobs == pytest.approx(plain.logprobs, abs=1e-6)


def test_window_queries_roll_across_prefill_and_decode(model):
    policy = RecompressingRule(rule=keep_all, query_window=3, interval=2, budget=1)
    seen = []

    def spy(layers, state):
        seen.append([(kv.query_positions.tolist(), tuple(kv.queries.shape)) for kv in layers])
        return RecompressingRule.select(policy, layers, state)

    policy.select = spy  # type: ignore[method-assign]
    result = oracle.generate(model, PROMPT, policy, 5)
    assert [c["step"] for c in result.compressions] == [0, 2, 4]
    p = len(PROMPT)
    expected = [[p - 3, p - 2, p - 1], [p - 1, p, p + 1], [p + 1, p + 2, p + 3]]
    assert [[pos for pos, _ in call] for call in seen] == [[e, e] for e in expected]
    assert all(shape == (4, 3, 32) for call in seen for _, shape in call)


def test_window_queries_are_post_rope_queries(model):
    captured: dict[int, torch.Tensor] = {}
    brute_force(model, PROMPT, 1, keep_all, set(), captured=captured)
    policy = RulePolicy(rule=keep_all, query_window=4)
    seen: dict[int, torch.Tensor] = {}

    def spy(layers, state):
        seen.update({kv.layer: kv.queries.clone() for kv in layers})
        return RulePolicy.select(policy, layers, state)

    policy.select = spy  # type: ignore[method-assign]
    oracle.generate(model, PROMPT, policy, 1)
    assert sorted(seen) == sorted(captured) == [0, 1]
    for layer, q in captured.items():
        torch.testing.assert_close(seen[layer], q[:, -4:], atol=1e-5, rtol=1e-5)


def test_invalid_selection_is_rejected(model):
    @dataclass
    class Unsorted(RulePolicy):
        def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
            n = kv.num_slots
            return Selection([torch.tensor([n - 1, n - 2])] * kv.num_kv_heads)

    with pytest.raises(ValueError, match="sorted, unique"):
        oracle.generate(model, PROMPT, Unsorted(), 2)


def test_requires_oracle_attention(tiny_dir):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(tiny_dir), attn_implementation="eager")
    with pytest.raises(ValueError, match="load_model"):
        oracle.generate(plain, PROMPT, None, 2)


def test_stop_token_ends_generation(model):
    free = oracle.generate(model, PROMPT, None, 8)
    stop = free.token_ids[2]
    stopped = oracle.generate(model, PROMPT, None, 8, stop_token_ids={stop})
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
