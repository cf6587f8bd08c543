"""Seeded, locally generated long-context tasks; each sample carries its checkable answers.

``TASKS`` maps a name to its :class:`~vllm_kvcomp.eval.tasks.base.TaskInfo`; sample ``i`` of a
task at a length depends only on (task, seed, length, i), so reruns and resumes see the same
prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_kvcomp.eval.tasks import multiturn, niah, passkey, ruler
from vllm_kvcomp.eval.tasks.base import Sample, TaskContext, TaskInfo, Turn

TASKS: dict[str, TaskInfo] = {**passkey.TASKS, **niah.TASKS, **multiturn.TASKS, **ruler.TASKS}

__all__ = ["TASKS", "Sample", "TaskContext", "TaskInfo", "Turn", "generate", "plan"]


def plan(tasks: Sequence[str], lengths: Sequence[int], samples: int) -> list[tuple[str, int, int]]:
    """(task, length, index) of every sample, in generation order; unknown names raise."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)} (allowed: {', '.join(TASKS)})")
    return [(t, n, i) for t in tasks for n in lengths for i in range(samples)]


def generate(ctx: TaskContext, task: str, length: int, index: int) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` tokens."""
    return TASKS[task].make(ctx, index, length)
