"""The report's curves: one plotly chart per metric group, training and validation on one step axis.

A key's group is the first part of its path once a leading ``val/`` is taken off
(``reward/mean`` and ``val/reward/mean@4`` are both in ``reward``; ``val/report/finding_f1_micro``
in ``report``); keys with no ``/`` are in ``overall``. Validation curves are dashed with markers.
A key ``K_se`` beside ``K`` is K's standard error, drawn as error bars on K rather than a curve
of its own. Spread keys (``/std``, ``/min``, ``/max``, ``_frac``) start hidden: a click on their
legend entry shows them. Each health alarm is a dotted red line at the step it fired, on every chart.
"""

from __future__ import annotations

from collections import defaultdict

# shown first, in this order; the rest alphabetically, then these last
FIRST = ("reward", "rewards", "health")
LAST = ("timing", "perf")
HIDDEN_SUFFIXES = ("/std", "/min", "/max", "_frac", "/applicable_frac", "/unscored_rows", "/unscored_steps")


def group_of(key: str) -> str:
    base = key.removeprefix("val/")
    return base.split("/", 1)[0] if "/" in base else "overall"


def metric_groups(keys) -> dict[str, list[str]]:
    """Group name -> its keys (``_se`` keys with their metric present left out), groups in display order."""
    keys = list(keys)
    present = set(keys)
    groups: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        if key.endswith("_se") and key[:-3] in present:
            continue
        groups[group_of(key)].append(key)
    order = sorted(groups, key=lambda g: (0, FIRST.index(g)) if g in FIRST else
                   (2, LAST.index(g)) if g in LAST else (1, g))
    return {g: groups[g] for g in order}


def alarm_steps(alarms: list[dict], metrics: dict[str, list]) -> dict[int, list[str]]:
    """Step -> the alarms that fired at it: alarms.jsonl's records, and each ``health/<alarm>`` key's
    steps where it turns 1 (from 0 or from its first step) for a run whose alarms.jsonl is missing them."""
    fired: dict[int, list[str]] = defaultdict(list)
    for a in alarms:
        name = str(a.get("alarm", "alarm"))
        if name not in fired[a["step"]]:
            fired[a["step"]].append(name)
    for key, series in metrics.items():
        if not key.startswith("health/"):
            continue
        name, before = key.removeprefix("health/"), 0.0
        for step, value in series:
            if value is not None and value >= 1 and before < 1 and name not in fired[step]:
                fired[step].append(name)
            before = value if value is not None else before
    return dict(sorted((s, names) for s, names in fired.items() if names))


def figure(group: str, keys: list[str], metrics: dict[str, list], fired: dict[int, list[str]]):
    """The plotly figure of one group."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for key in keys:
        series = metrics[key]
        steps = [s for s, _ in series]
        values = [v for _, v in series]
        validation = key.startswith("val/")
        error = None
        if key + "_se" in metrics:
            se = dict(metrics[key + "_se"])
            error = dict(type="data", array=[se.get(s) for s in steps], visible=True)
        fig.add_trace(go.Scatter(
            x=steps, y=values, name=key, error_y=error,
            mode="lines+markers" if validation or len(steps) < 30 else "lines",
            line=dict(dash="dash") if validation else None,
            visible="legendonly" if key.endswith(HIDDEN_SUFFIXES) else True,
        ))
    for step, names in fired.items():
        fig.add_vline(x=step, line_dash="dot", line_color="red", line_width=1.5,
                      annotation_text=", ".join(names), annotation_font_color="red",
                      annotation_position="top left")
    fig.update_layout(title=dict(text=group, x=0.01), height=340, margin=dict(l=50, r=20, t=40, b=40),
                      xaxis_title="step", legend=dict(font=dict(size=10)), template="plotly_white")
    return fig


def chart_divs(metrics: dict[str, list], fired: dict[int, list[str]]) -> list[tuple[str, str]]:
    """(group, HTML div with its plot script) of each group; plotly.js itself is embedded once by the page."""
    out = []
    for i, (group, keys) in enumerate(metric_groups(metrics).items()):
        fig = figure(group, keys, metrics, fired)
        div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"chart-{i}",
                          config={"displaylogo": False, "responsive": True})
        out.append((group, div))
    return out


def plotly_js() -> str:
    """plotly.js, minified, from the installed plotly package: embedded in the page, so it opens offline."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().replace("</script", "<\\/script")
