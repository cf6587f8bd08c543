"""PNG plots of the eval cells (matplotlib, no display needed).

- ``accuracy_<task>.png``: accuracy (Wilson 95 % error bars) vs requested kept ratio, a line per
  condition, a panel per length; ``full`` is the dashed baseline with its interval shaded.
- ``memory_<task>.png``: accuracy (error bars) vs the KV the server reported holding in decode
  (mean ``kept_fraction``; horizontal bars span its range over the samples), a line per
  condition, ``full`` as the reference point and band. The picture to choose a policy from.
- ``heatmap_<task>_<condition>.png`` (tasks with a needle depth): mean score over depth x
  length, a panel per ratio.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_kvcomp.eval.cells import Row, condition_of, format_length, latest, mean, policy_rank

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def _bars(points: Sequence[tuple[float | None, float | None, float | None]]) -> list[list[float]]:
    """Asymmetric error bars [[below...], [above...]] from (centre, low, high) per point (a
    missing bound: no bar; never negative, also when a mean of equal values rounds past them)."""
    below = [max(0.0, (c or 0.0) - (lo if lo is not None else c or 0.0)) for c, lo, _ in points]
    above = [max(0.0, (hi if hi is not None else c or 0.0) - (c or 0.0)) for c, _, hi in points]
    return [below, above]


def _yerr(cells: Sequence[Row]) -> list[list[float]]:
    """Error bars from each row's Wilson interval."""
    return _bars([(w.accuracy, w.low, w.high) for w in cells])


def _conditions(cells: Sequence[Row]) -> list[str]:
    return sorted({w.condition for w in cells}, key=lambda c: (policy_rank(c), c))


def _styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Matplotlib styles: a colour per base policy (registry order); a condition with settings
    (``lagkv:lag=64``) keeps its policy's colour with a dashed line and its own marker."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    markers = ("s", "^", "D", "v", "P", "X")
    out: dict[str, dict[str, Any]] = {}
    variants: dict[str, int] = {}
    for name in names:
        base = name.split(":", 1)[0]
        style: dict[str, Any] = {"color": cmap(policy_rank(base) % 10), "marker": "o"}
        if name != base:
            variants[base] = variants.get(base, -1) + 1
            style.update(linestyle="--", marker=markers[variants[base] % len(markers)])
        out[name] = style
    return out


def _full_band(ax: Axes, row: Row) -> None:
    ax.axhline(row.accuracy, color="black", linestyle="--", label=f"full (n={row.n})")
    if row.low is not None and row.high is not None:
        ax.axhspan(row.low, row.high, color="black", alpha=0.08, linewidth=0)


def _accuracy_panel(ax: Axes, cells: Sequence[Row], styles: dict[str, dict[str, Any]]) -> None:
    names = [n for n in _conditions(cells) if n != "full"]
    for name in _conditions(cells):
        line = sorted((w for w in cells if w.condition == name), key=lambda w: w.ratio)
        if name == "full":
            _full_band(ax, line[0])
            continue
        dodge = 1.0 + 0.012 * (names.index(name) - (len(names) - 1) / 2)  # error bars side by side
        ax.errorbar([w.ratio * dodge for w in line], [w.accuracy for w in line], yerr=_yerr(line),
                    capsize=3, label=name, **styles[name])
    ratios = sorted({w.ratio for w in cells})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ratios, [f"{r:g}" for r in ratios])
    ax.minorticks_off()
    ax.invert_xaxis()
    ax.set_xlabel("requested kept ratio (more compression →)")


def _memory_panel(ax: Axes, cells: Sequence[Row], styles: dict[str, dict[str, Any]]) -> None:
    for name in _conditions(cells):
        line = sorted((w for w in cells if w.condition == name and w.kept is not None),
                      key=lambda w: w.kept or 0.0)
        if not line:
            continue
        if name == "full":
            _full_band(ax, line[0])
            ax.plot([line[0].kept], [line[0].accuracy], marker="*", markersize=12, color="black")
            continue
        xerr = _bars([(w.kept, w.kept_min, w.kept_max) for w in line])  # kept over the samples
        ax.errorbar([w.kept for w in line], [w.accuracy for w in line], yerr=_yerr(line),
                    xerr=xerr, capsize=3, label=name, **styles[name])
    ax.set_xlim(0.0, 1.05)
    ax.set_xlabel("KV held in decode (kept_fraction, full = 1)")


def _plot(rows: Sequence[Row], folder: Path, prefix: str, panel: Any, memory: bool) -> list[Path]:
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for task in sorted({w.task for w in rows}):
        mine = [w for w in rows if w.task == task and w.accuracy is not None]
        if memory:
            mine = [w for w in mine if w.kept is not None]
        lengths = sorted({w.length for w in mine})
        if not lengths:
            continue
        styles = _styles(_conditions(mine))
        fig = Figure(figsize=(5.2 * len(lengths) + 1.8, 4.2), layout="constrained")
        axes = fig.subplots(1, len(lengths), squeeze=False)[0]
        for ax, length in zip(axes, lengths):
            panel(ax, [w for w in mine if w.length == length], styles)
            ax.set_ylim(-0.03, 1.03)
            ax.set_title(f"{task}, {format_length(length)} tokens")
            ax.set_ylabel("accuracy (95% Wilson interval)")
            ax.grid(alpha=0.3)
        handles, labels = axes[-1].get_legend_handles_labels()
        fig.legend(handles, labels, fontsize="small", loc="outside right center")
        path = folder / f"{prefix}_{task}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def plot_accuracy(rows: Sequence[Row], folder: Path) -> list[Path]:
    """``accuracy_<task>.png`` per task: accuracy vs requested kept ratio, a panel per length."""
    return _plot(rows, folder, "accuracy", _accuracy_panel, memory=False)


def plot_memory(rows: Sequence[Row], folder: Path) -> list[Path]:
    """``memory_<task>.png`` per task: accuracy vs measured KV held, a panel per length."""
    return _plot(rows, folder, "memory", _memory_panel, memory=True)


def file_label(condition: str) -> str:
    """A condition label as a file-name part (``lagkv:lag=64`` -> ``lagkv_lag64``)."""
    return condition.replace(":", "_").replace("=", "")


def _heatmap(task: str, condition: str, grid: dict[tuple[float, float, int], list[float]],
             folder: Path) -> Path:
    from matplotlib.figure import Figure

    ratios = sorted({k[0] for k in grid}, reverse=True)
    depths = sorted({k[1] for k in grid})
    lengths = sorted({k[2] for k in grid})
    fig = Figure(figsize=(1.2 + 1.1 * len(lengths) * len(ratios) + 1.0, 1.4 + 0.45 * len(depths)),
                 layout="constrained")
    axes = fig.subplots(1, len(ratios), squeeze=False)[0]
    image = None
    for ax, ratio in zip(axes, ratios):
        matrix = [[mean(grid.get((ratio, d, n), [])) for n in lengths] for d in depths]
        values = [[float("nan") if v is None else v for v in row] for row in matrix]
        image = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                if v is not None:
                    n = len(grid.get((ratio, depths[i], lengths[j]), []))
                    ax.text(j, i, f"{v:.2f}\nn={n}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [format_length(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(condition if condition == "full" else f"{condition}, ratio {ratio:g}")
    fig.suptitle(f"{task}: accuracy by needle depth and length")
    fig.colorbar(image, ax=list(axes), shrink=0.9, label="accuracy")
    path = folder / f"heatmap_{task}_{file_label(condition)}.png"
    fig.savefig(path, dpi=110)
    return path


def plot_heatmaps(records: Iterable[dict[str, Any]], folder: Path) -> list[Path]:
    """``heatmap_<task>_<condition>.png``: mean score over depth x length, a panel per ratio."""
    folder.mkdir(parents=True, exist_ok=True)
    cells: dict[tuple[str, str], dict[tuple[float, float, int], list[float]]] = defaultdict(
        lambda: defaultdict(list))
    for r in latest(records):
        if not r.get("error") and r.get("depth") is not None:
            key = (float(r["ratio"]), float(r["depth"]), int(r["length"]))
            cells[(r["task"], condition_of(r))][key].append(r["score"])
    order = sorted(cells, key=lambda k: (k[0], policy_rank(k[1]), k[1]))
    return [_heatmap(task, condition, cells[(task, condition)], folder) for task, condition in order]
