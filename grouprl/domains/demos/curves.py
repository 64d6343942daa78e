"""Training curves from a run's ``metrics.jsonl``: what the demos plot."""

from __future__ import annotations

from pathlib import Path

from grouprl.files import AtomicFile, read_json_records

# Fewer steps than this make a few dots, not a curve: nothing is drawn and the caller says so.
MIN_CURVE_POINTS = 5


def reward_series(metrics_file: Path, key: str = "reward/mean") -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` in a run's metrics file, in file order."""
    steps, values = [], []
    for row in read_json_records(metrics_file):
        if row.get(key) is not None:
            steps.append(row["step"])
            values.append(row[key])
    return steps, values


def moving_average(values: list[float], window: int) -> list[float]:
    """``m_i = mean(v_{max(0, i-w+1)} .. v_i)``: the trailing mean, shorter at the start."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def plot_reward_curves(curves: dict[str, Path], png: Path, *, ylabel: str = "mean training reward",
                       title: str = "grouprl: training reward", xlabel: str = "GRPO step") -> Path | None:
    """Mean training reward per step of each run in ``curves`` (label -> metrics.jsonl), drawn by
    ``reward_curve_figure``; the path written, or None (nothing written) when a run has fewer than
    ``MIN_CURVE_POINTS`` steps."""
    series = {label: reward_series(path) for label, path in curves.items()}
    if not series or min(len(steps) for steps, _ in series.values()) < MIN_CURVE_POINTS:
        return None
    import matplotlib.pyplot as plt

    fig = reward_curve_figure(series, xlabel=xlabel, ylabel=ylabel, title=title)
    with AtomicFile(png, "wb") as fh:
        fig.savefig(fh, format="png", dpi=120)
    plt.close(fig)
    return png


def reward_curve_figure(series: dict[str, tuple[list[int], list[float]]], *, xlabel: str, ylabel: str, title: str):
    """A matplotlib figure: per run, the values per step as faint dots under their trailing mean over
    about a twelfth of the run, or, for runs too short to smooth, the values joined by a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, (steps, means) in series.items():
        window = len(means) // 12
        if window >= 2:
            (line,) = ax.plot(steps, moving_average(means, window), linewidth=2,
                              label=f"{label} (mean of the last {window} steps)")
            ax.plot(steps, means, marker="o", markersize=2, alpha=0.25, linewidth=0.8, color=line.get_color())
        else:
            ax.plot(steps, means, marker="o", markersize=3, linewidth=1.5, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def curve_line(png: Path | None, what: str, curves: dict[str, Path]) -> str:
    """The line a demo prints about its curve: where it is, or why there is none."""
    if png is not None:
        return f"{what}: {png.resolve()}"
    steps = min(len(reward_series(path)[0]) for path in curves.values())
    return (f"{what}: not drawn ({steps} logged steps; a curve needs at least {MIN_CURVE_POINTS}); "
            f"the per-step rewards are in {', '.join(str(p) for p in curves.values())}")
