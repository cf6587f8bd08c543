"""What a policy setting is: a typed, range-checked parameter, and the error a bad one raises.

Shared by the registry (which declares each policy's parameters), the spec (which validates a
request against them) and the policies (which read them). Depends on nothing else in the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

Scalar = int | float | str | bool


class SpecError(ValueError):
    """Invalid compression input. ``field`` names the offending key, ``allowed`` what would work."""

    def __init__(self, field: str, message: str, allowed: str | None = None):
        self.field = field
        self.message = message
        self.allowed = allowed
        text = f"{field}: {message}"
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(text)


@dataclass(frozen=True)
class Param:
    """One tunable of a policy: type, default and the closed range of accepted values."""

    name: str
    kind: type
    default: Any
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] | None = None
    help: str = ""

    def allowed(self) -> str:
        if self.choices:
            return ", ".join(self.choices)
        kind = "integer" if self.kind is int else "number" if self.kind is float else "string"
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        if self.kind is float and self.low == 0.0 and self.high == 1.0 and self.name == "ratio":
            return "a number in (0, 1]"
        return f"{kind} in [{lo}, {hi}]"

    def coerce(self, value: Any) -> Any:
        """Convert ``value`` (possibly a string from a header) to this param's type, or raise."""
        if value is None:
            return None
        if self.kind is str:
            if not isinstance(value, str):
                raise SpecError(self.name, f"expected a string, got {value!r}", self.allowed())
            text = value.strip().lower()
            if self.choices and text not in self.choices:
                raise SpecError(self.name, f"unknown value {value!r}", self.allowed())
            return text
        if isinstance(value, bool):
            raise SpecError(self.name, f"expected a number, got {value!r}", self.allowed())
        try:
            number = float(value) if isinstance(value, str) else value
            if self.kind is int:
                if isinstance(number, float) and not number.is_integer():
                    raise ValueError
                number = int(number)
            else:
                number = float(number)
        except (TypeError, ValueError, OverflowError):
            raise SpecError(self.name, f"not a valid {self.kind.__name__}: {value!r}", self.allowed()) from None
        if isinstance(number, float) and not math.isfinite(number):
            raise SpecError(self.name, f"must be finite, got {value!r}", self.allowed())
        if self.low is not None and number < self.low:
            raise SpecError(self.name, f"{number:g} is below the minimum", self.allowed())
        if self.high is not None and number > self.high:
            raise SpecError(self.name, f"{number:g} is above the maximum", self.allowed())
        return number


# Fields every policy may understand; a policy declares which of them it uses.
COMMON_PARAMS: dict[str, Param] = {
    p.name: p
    for p in (
        Param("ratio", float, None, 0.0, 1.0, help="fraction of tokens kept per head, in (0, 1]"),
        Param("budget", int, None, 1, 1 << 24, help="absolute kept tokens per head"),
        Param("sink", int, None, 0, 1 << 16, help="first tokens always kept"),
        Param("window", int, None, 0, 1 << 20, help="recent tokens always kept / observed"),
        Param("lag", int, None, 1, 1 << 16, help="LagKV partition size L"),
        Param("interval", int, None, 1, 1 << 20, help="decode steps between recompressions"),
    )
}


def kept_count(n_tokens: int, ratio: float | None, budget: int | None) -> int:
    """Tokens kept out of ``n_tokens``: ``budget`` if given, else ``ceil(ratio * n)``, clamped to [1, n]."""
    if n_tokens <= 0:
        return 0
    if budget is not None:
        want = budget
    elif ratio is not None:
        want = math.ceil(ratio * n_tokens - 1e-9)
    else:
        want = n_tokens
    return max(1, min(n_tokens, int(want)))
