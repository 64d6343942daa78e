"""Training curves from a run's ``metrics.jsonl``: what the demos plot."""

from __future__ import annotations

from pathlib import Path

from grouprl.files import AtomicFile, read_json_records


def plot_reward_curves(curves: dict[str, Path], png: Path, *, ylabel: str = "mean training reward",
                       title: str = "grouprl: training reward") -> None:
    """Mean training reward per GRPO step (faint) and its moving average, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, metrics_file in curves.items():
        steps, means = [], []
        for row in read_json_records(metrics_file):
            if row.get("reward/mean") is not None:
                steps.append(row["step"])
                means.append(row["reward/mean"])
        window = max(1, len(means) // 12)
        smooth = [sum(means[max(0, i - window + 1):i + 1]) / len(means[max(0, i - window + 1):i + 1])
                  for i in range(len(means))]
        (line,) = ax.plot(steps, smooth, linewidth=2, label=f"{label} (mean of last {window})")
        ax.plot(steps, means, marker="o", markersize=2, alpha=0.25, color=line.get_color())
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    with AtomicFile(png, "wb") as fh:
        fig.savefig(fh, format="png", dpi=120)
    plt.close(fig)
