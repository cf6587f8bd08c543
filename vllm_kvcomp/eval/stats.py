"""Confidence intervals for per-cell accuracies.

Every cell's score is a mean of per-sample scores in [0, 1]. For exact-match tasks these are
Bernoulli draws and :func:`wilson` is the Wilson score interval. For partial-credit scores
(``passkey64`` prefix, ``multi_niah`` recall, ``vt`` / ``cwe`` / ``fwe`` word recall, the mean of two
``multiturn`` turns) the same
formula is conservative: a variable in [0, 1] with mean p has variance at most p(1 - p), the
Bernoulli variance the interval assumes.
"""

from __future__ import annotations

import math

#: two-sided 95 % normal quantile
Z95 = 1.959963984540054


def wilson(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` of a proportion ``mean`` observed over ``n`` samples.

    ``n == 0`` gives the uninformative ``(0, 1)``; ``mean`` is clamped to [0, 1].
    """
    if n <= 0:
        return 0.0, 1.0
    p = min(1.0, max(0.0, float(mean)))
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n)) / denom
    low = 0.0 if p == 0.0 else max(0.0, centre - half)  # exact bounds where rounding would blur
    high = 1.0 if p == 1.0 else min(1.0, centre + half)
    return low, high


__all__ = ["Z95", "wilson"]
