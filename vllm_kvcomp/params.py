"""What a policy setting is: a typed, range-checked parameter, and the error a bad one raises.

Shared by the registry (which declares each policy's parameters), the spec (which validates a
request against them) and the policies (which read them). Depends on nothing else in the package.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

Scalar = int | float | str | bool
#: A number written as text: ASCII digits only (``float()`` would also take "０.２５", "1_000",
#: "inf" or surrounding unicode spaces).
NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
#: Longest value quoted back in an error message.
SHOWN_CHARS = 40


def show(value: Any) -> str:
    """``repr(value)`` for error messages, cut to :data:`SHOWN_CHARS` characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**SHOWN_CHARS:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


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
        lo = "-inf" if self.low is None else _fmt(int(self.low) if self.kind is int else self.low)
        hi = "inf" if self.high is None else _fmt(int(self.high) if self.kind is int else self.high)
        if self.kind is float and self.low == 0.0 and self.high == 1.0 and self.name == "ratio":
            return "a number in (0, 1]"
        return f"{kind} in [{lo}, {hi}]"

    def coerce(self, value: Any) -> Any:
        """Convert ``value`` (possibly a string from a header) to this param's type, or raise."""
        if value is None:
            return None
        if self.kind is str:
            if not isinstance(value, str):
                raise SpecError(self.name, f"expected a string, got {show(value)}", self.allowed())
            text = value.strip().lower()
            if self.choices and text not in self.choices:
                raise SpecError(self.name, f"unknown value {show(value)}", self.allowed())
            return text
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise SpecError(self.name, f"expected a number, got {show(value)}", self.allowed())
        number = self._number(value)
        if isinstance(number, float) and not math.isfinite(number):
            raise SpecError(self.name, f"must be finite, got {show(value)}", self.allowed())
        if self.low is not None and number < self.low:
            raise SpecError(self.name, f"{_fmt(number)} is below the minimum", self.allowed())
        if self.high is not None and number > self.high:
            raise SpecError(self.name, f"{_fmt(number)} is above the maximum", self.allowed())
        return number

    def _number(self, value: int | float | str) -> int | float:
        """``value`` as this param's number type; text must be an ASCII decimal number."""
        number = value
        if isinstance(value, str):
            text = value.strip(" \t")
            if not NUMBER_TEXT.fullmatch(text):
                raise SpecError(self.name, f"not a valid {self.kind.__name__}: {show(value)}",
                                f"{self.allowed()}, in ASCII digits")
            number = float(text)
        if self.kind is float:
            try:
                return float(number)
            except OverflowError:  # an integer beyond float range
                return math.inf if number > 0 else -math.inf
        if isinstance(number, float) and not number.is_integer():
            raise SpecError(self.name, f"not a valid int: {show(value)}", self.allowed())
        return int(number)


def _fmt(number: int | float) -> str:
    """A number for an error message (huge integers are not converted to float)."""
    if isinstance(number, int):
        return str(number) if abs(number) < 10**SHOWN_CHARS else show(number)
    return f"{number:g}"


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
