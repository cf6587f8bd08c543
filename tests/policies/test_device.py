"""Policies decide on the engine's device (the worker gives them K/V and queries where the cache
is, lengths and positions on the host) what they decide on the host: every policy and variant,
the prompt-end compression and every recompression of 40 decode steps (GPU only)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from tests.policies.conftest import CASES, FakeRequest, compressions, make_case, recompressing_cases
from vllm_kvcomp.policies.base import LayerKV, Policy, Selection

pytestmark = pytest.mark.gpu

#: CASES and the one-shot policies asked to recompress (the recompressing ones are in CASES)
DEVICE_CASES = CASES + [case for case in recompressing_cases() if "decode=recompress" in case.values[0][0]]


@dataclass
class PlacedRequest(FakeRequest):
    """A :class:`FakeRequest` whose layers reach the policy in float64 on ``device`` (where the
    worker leaves K/V, queries and the output projection); selections come back to the host."""

    device: str = "cpu"

    def inputs(self, policy: Policy) -> list[LayerKV]:
        def place(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device, torch.float64)

        return [replace(kv, keys=place(kv.keys), values=place(kv.values), queries=place(kv.queries),
                        out_proj=place(kv.out_proj)) for kv in super().inputs(policy)]

    def apply(self, selections: list[Selection]) -> None:
        super().apply([sel.cpu() for sel in selections])


@pytest.mark.parametrize("ragged", [False, True], ids=["equal", "ragged"])
@pytest.mark.parametrize("case", DEVICE_CASES)
def test_decides_on_the_device_what_it_decides_on_the_host(case, ragged):
    host, device = (PlacedRequest.random(97, num_kv_heads=3, group=3, ragged=ragged, seed=11) for _ in range(2))
    device.device = "cuda"
    runs = zip(compressions(make_case(case), host, decode_steps=40),
               compressions(make_case(case), device, decode_steps=40), strict=True)
    count = 0
    for count, (on_host, on_device) in enumerate(runs, 1):
        assert on_device.state.budget == on_host.state.budget
        for layer, (want, got) in enumerate(zip(on_host.selections, on_device.selections)):
            got = got.cpu()
            for h, (w, g) in enumerate(zip(want.indices, got.indices)):
                assert torch.equal(w, g), f"compression {count}, layer {layer}, head {h}"
            assert (want.compensation is None) == (got.compensation is None)
            if want.compensation is not None:
                for name in ("keys", "values", "counts"):
                    torch.testing.assert_close(getattr(got.compensation, name), getattr(want.compensation, name))
    assert count >= 1
