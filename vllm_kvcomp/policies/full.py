"""``full``: keep everything (the no-op policy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_kvcomp.policies.base import LayerKV, Policy, RequestState, Selection


@dataclass
class Full(Policy):
    name: ClassVar[str] = "full"
    KEEPS: ClassVar[str] = "everything"
    CAN_RECOMPRESS: ClassVar[bool] = False

    def select_layer(self, kv: LayerKV, state: RequestState) -> Selection:
        return Selection.keep_valid(kv)
