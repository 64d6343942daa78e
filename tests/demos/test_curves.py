"""The demos' reward curves: whole-number step ticks, no curve from a handful of steps."""

import json

import pytest

from grouprl.domains.demos.curves import (MIN_CURVE_POINTS, curve_line, moving_average, plot_reward_curves,
                                          reward_curve_figure)


def write_metrics(path, rewards):
    path.write_text("".join(json.dumps({"step": i + 1, "reward/mean": r, "actor/lr": 1e-4}) + "\n"
                            for i, r in enumerate(rewards)))
    return path


def test_a_run_shorter_than_five_steps_draws_no_curve_and_says_why(tmp_path):
    short = write_metrics(tmp_path / "short.jsonl", [0.1, 0.2, 0.3, 0.4])
    long = write_metrics(tmp_path / "long.jsonl", [0.1] * 30)
    png = tmp_path / "curve.png"
    assert MIN_CURVE_POINTS == 5
    # one short run is enough to leave the whole plot out
    assert plot_reward_curves({"a": long, "b": short}, png) is None and not png.exists()
    line = curve_line(None, "reward curve", {"a": long, "b": short})
    assert "not drawn (4 logged steps; a curve needs at least 5)" in line and str(short) in line
    write_metrics(short, [0.1, 0.2, 0.3, 0.4, 0.5])
    assert plot_reward_curves({"a": long, "b": short}, png) == png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert curve_line(png, "reward curve", {"a": long}) == f"reward curve: {png.resolve()}"


@pytest.mark.parametrize("steps", [5, 7, 13])
def test_step_ticks_are_whole_numbers(steps):
    import matplotlib.pyplot as plt

    fig = reward_curve_figure({"run": (list(range(1, steps + 1)), [0.1 * i for i in range(steps)])},
                              xlabel="step", ylabel="reward", title="t")
    fig.canvas.draw()
    ticks = fig.axes[0].get_xticks()
    plt.close(fig)
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks)


def test_only_runs_long_enough_to_smooth_are_smoothed():
    import matplotlib.pyplot as plt

    fig = reward_curve_figure({"short": (list(range(1, 13)), [0.0] * 12), "long": (list(range(1, 121)), [0.0] * 120)},
                              xlabel="step", ylabel="reward", title="t")
    labels = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    plt.close(fig)
    # no "mean of the last 1": a short run is its values, a long one gets the mean of a twelfth of it
    assert labels == ["short", "long (mean of the last 10 steps)"]


def test_moving_average_is_the_trailing_mean():
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
