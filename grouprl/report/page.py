"""The report page: one self-contained HTML file built from a :class:`~grouprl.report.reading.Run`.

Everything is inside the file: plotly.js inline, images as ``data:`` URIs, a few lines of
plain JavaScript for the step selectors. Caps keep a long run's page usable; what a cap
leaves out is counted on the page next to what is shown.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from grouprl.report import charts
from grouprl.report.reading import IMAGE_SUFFIXES, Run
from grouprl.report.views import RECORD_VIEWS

# the record fields the rollout browser shows itself (the rest: views, then name: value lines)
COMMON_FIELDS = {"step", "id", "group", "prompt", "response", "reference", "rewards", "score", "advantage",
                 "images", "image", "logged", "truncated", "edited"}
MAX_IMAGE_BYTES = 400_000  # an image file larger than this is embedded as a smaller copy
THUMBNAIL_SIDE = 768


@dataclass(frozen=True)
class Caps:
    """How much of a large run the page embeds (``grouprl report --max-...``).

    ``rollouts_per_step``: completions of one step in the rollout browser (whole prompt groups);
    ``steps``: steps of the rollout browser, and of the validation generations, spread evenly over
    the run, first and last included; ``images``: images on the page; ``text_chars``: characters of
    one prompt or completion."""

    rollouts_per_step: int = 32
    steps: int = 50
    images: int = 200
    text_chars: int = 4000

    def __post_init__(self):
        for name in ("rollouts_per_step", "steps", "images", "text_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"report cap {name} must be a positive integer, got {value!r}")


def spread_steps(steps: list[int], cap: int) -> list[int]:
    """At most ``cap`` of ``steps`` (sorted), evenly spread, the first and the last always among them."""
    if len(steps) <= cap:
        return steps
    if cap == 1:
        return [steps[-1]]
    picks = {round(i * (len(steps) - 1) / (cap - 1)) for i in range(cap)}
    return [steps[i] for i in sorted(picks)]


class Images:
    """Images of the run directory as data: URIs, up to a cap; counts those left out."""

    def __init__(self, run_dir: Path, cap: int):
        self.run_dir, self.cap = run_dir, cap
        self.embedded = 0
        self.left_out = 0

    def tag(self, path_text: Any, alt: str, css: str = "") -> str:
        path = Path(str(path_text))
        path = (path if path.is_absolute() else self.run_dir / path).resolve()
        shown = html.escape(str(path_text))
        # the report reads the run directory only: a record naming a file elsewhere is not followed
        if not path.is_relative_to(self.run_dir) or not path.is_file() or path.suffix.lower() not in IMAGE_SUFFIXES:
            return f'<span class="missing">image {shown}: not a file in the run directory</span>'
        if self.embedded >= self.cap:
            self.left_out += 1
            return f'<span class="missing">image {shown} left out (cap of {self.cap} images)</span>'
        data = path.read_bytes()
        mime = "image/" + {".jpg": "jpeg", ".jpeg": "jpeg"}.get(path.suffix.lower(), path.suffix.lower()[1:])
        if len(data) > MAX_IMAGE_BYTES:
            data, mime = _smaller(data), "image/png"
        self.embedded += 1
        uri = "data:" + mime + ";base64," + base64.b64encode(data).decode("ascii")
        return f'<img class="{css}" src="{uri}" alt="{html.escape(alt)}" title="{shown}">'


def _smaller(data: bytes) -> bytes:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
        out = io.BytesIO()
        image.save(out, format="PNG")
    return out.getvalue()


# control characters a browser would drop or act on (NUL, CR, ESC ...), shown as \\xNN; tab and newline kept
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x09), *range(0x0b, 0x20), 0x7f]}


def visible_text(text: str) -> str:
    """``text`` as the page shows it: each control character but tab and newline written as ``\\xNN``,
    so that a policy's stray NUL or carriage return is seen, not dropped or obeyed by the browser."""
    return text.translate(_CONTROL)


def _clip(text: Any, cap: int) -> str:
    """HTML for <pre>: a leading newline that the parser would drop is kept, text past ``cap`` is cut with a note."""
    text = visible_text("" if text is None else str(text))
    shown = html.escape(text[:cap])
    if text.startswith("\n"):  # a newline right after <pre> is eaten by the HTML parser
        shown = "\n" + shown
    if len(text) <= cap:
        return shown
    return shown + f'<span class="missing"> ... ({len(text) - cap} more characters)</span>'


def _number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return html.escape(str(value)) if value is not None else "&ndash;"
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _groups(records: list[dict]) -> list[list[dict]]:
    """A step's records by prompt group (the ``group`` field; records without one: by prompt), in file order."""
    groups: dict[Any, list[dict]] = {}
    for r in records:
        key = ("group", r["group"]) if "group" in r else ("prompt", str(r.get("prompt")))
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _capped(groups: list[list[dict]], cap: int) -> tuple[list[list[dict]], int]:
    """Whole groups while they fit in ``cap`` records (the first group cut to ``cap`` if it alone is larger)."""
    shown, count = [], 0
    for group in groups:
        if count + len(group) > cap:
            if not shown:
                shown.append(group[:cap])
                count = cap
            break
        shown.append(group)
        count += len(group)
    return shown, sum(len(g) for g in groups) - count


def _views() -> list[tuple[str, Any]]:
    from grouprl.registry import load_plugins

    load_plugins()  # the domains' views are registered when their plugins load
    return list(RECORD_VIEWS.items())


def _extras(record: dict, claimed: set[str]) -> str:
    parts = []
    for key, value in record.items():
        if key in COMMON_FIELDS or key in claimed:
            continue
        if isinstance(value, (str, int, float, bool)) or value is None:
            text = _number(value) if not isinstance(value, str) else html.escape(value[:200])
            parts.append(f"<span><b>{html.escape(key)}</b>: {text}</span>")
    logged = record.get("logged")
    if isinstance(logged, dict):
        parts.extend(f"<span><b>{html.escape(k)}</b>: {_number(v)}</span>" for k, v in logged.items()
                     if not isinstance(v, (dict, list)))
    return f'<div class="extras">{" ".join(parts)}</div>' if parts else ""


def _image_list(record: dict) -> list:
    images = record.get("images")
    if isinstance(images, list):
        return [i for i in images if isinstance(i, str)]
    return [record["image"]] if isinstance(record.get("image"), str) else []


def rollout_group_html(group: list[dict], caps: Caps, images: Images, views) -> str:
    """One prompt group: its prompt (and images, reference), then each completion with its rewards,
    score, advantage and the views of its other fields."""
    first = group[0]
    claimed = {f for _, view in views for f in view.fields}
    components = list(dict.fromkeys(k for r in group for k in (r.get("rewards") or {})))
    ident = f" &middot; {html.escape(str(first['id']))}" if first.get("id") is not None else ""
    head = [f'<div class="prompt"><div class="label">prompt{ident}</div>'
            f'<pre>{_clip(first.get("prompt"), caps.text_chars)}</pre>']
    prompt_images = first.get("images") if isinstance(first.get("images"), list) and "response" in first else []
    if prompt_images:
        head.append('<div class="thumbs">' + "".join(images.tag(p, "prompt image", "prompt-image")
                                                     for p in prompt_images) + "</div>")
    if first.get("reference") is not None:
        head.append(f'<div class="label">reference</div><pre class="reference">{_clip(first["reference"], caps.text_chars)}</pre>')
    head.append("</div>")
    rows = []
    header = "".join(f"<th>{html.escape(c)}</th>" for c in components)
    for i, r in enumerate(group):
        rewards = r.get("rewards") or {}
        cells = "".join(f"<td>{_number(rewards.get(c))}</td>" for c in components)
        flags = " ".join(f for f in ("truncated", "edited") if r.get(f))
        if "response" in r:
            body = f'<pre class="completion">{_clip(r.get("response"), caps.text_chars)}</pre>'
        else:  # an image rollout (flow): its image if the run saved it
            body = "".join(images.tag(p, f"sample {i + 1}", "sample-image") for p in _image_list(r)) or \
                   '<span class="missing">(image not saved by the run)</span>'
        if "response" in r and "images" not in r and isinstance(r.get("image"), str):
            body += images.tag(r["image"], f"sample {i + 1}", "sample-image")
        below = [html_ for _, view in views if (html_ := view.render(r))]
        below.append(_extras(r, claimed))
        rows.append(f'<tr><td>{i + 1}</td><td class="text">{body}{"".join(below)}</td>{cells}'
                    f'<td>{_number(r.get("score"))}</td><td>{_number(r.get("advantage"))}</td>'
                    f'<td class="flags">{flags}</td></tr>')
    table = (f'<table class="completions"><tr><th>#</th><th>completion</th>{header}<th>score</th>'
             f'<th>advantage</th><th></th></tr>{"".join(rows)}</table>')
    return f'<div class="group">{"".join(head)}{table}</div>'


def rollout_steps(run: Run, caps: Caps, images: Images) -> tuple[list[dict], int]:
    """The rollout browser's steps ({"step", "html", "note"}) and how many logged steps it leaves out."""
    views = _views()
    steps = spread_steps(list(run.rollouts), caps.steps)
    out = []
    for step in steps:
        shown, left = _capped(_groups(run.rollouts[step]), caps.rollouts_per_step)
        total = len(run.rollouts[step])
        note = (f"{total - left} of {total} rollouts shown; {left} left out (cap: {caps.rollouts_per_step} "
                f"per step, --max-rollouts-per-step)") if left else f"{total} rollouts"
        body = "".join(rollout_group_html(g, caps, images, views) for g in shown)
        out.append({"step": step, "html": Markup(body), "note": note})
    return out, len(run.rollouts) - len(steps)


def validation_steps(run: Run, caps: Caps, images: Images) -> tuple[list[dict], int]:
    """Validation generations and image grids by step, as the rollout browser's steps."""
    all_steps = sorted(set(run.val_generations) | set(run.val_images))
    steps = spread_steps(all_steps, caps.steps)
    out = []
    for step in steps:
        parts = [images.tag(p, f"validation images, step {step}", "grid") for p in run.val_images.get(step, [])]
        records = run.val_generations.get(step, [])
        shown = records[:caps.rollouts_per_step]
        if shown:
            columns = [c for c in ("id", "prompt", "response", "reference", "score") if any(c in r for r in shown)]
            extra = list(dict.fromkeys(k for r in shown for k in r if k not in columns and k != "step"
                                       and isinstance(r[k], (int, float, str, bool))))
            head = "".join(f"<th>{html.escape(c)}</th>" for c in columns + extra)
            rows = "".join("<tr>" + "".join(
                f'<td class="text"><pre>{_clip(r.get(c), caps.text_chars)}</pre></td>' if c in ("prompt", "response", "reference")
                else f"<td>{_number(r.get(c)) if not isinstance(r.get(c), str) else html.escape(r[c])}</td>"
                for c in columns + extra) + "</tr>" for r in shown)
            parts.append(f'<table class="completions"><tr>{head}</tr>{rows}</table>')
        left = len(records) - len(shown)
        note = f"{len(shown)} of {len(records)} generations shown; {left} left out (--max-rollouts-per-step)" \
            if left else f"{len(records)} generations"
        out.append({"step": step, "html": Markup("".join(parts)), "note": note})
    return out, len(all_steps) - len(steps)


def _info_rows(run: Run) -> list[tuple[str, str]]:
    return [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in run.run_info.items() if k != "best"]


def _max_steps(run: Run) -> Any:
    if run.config_text is None:
        return None
    import yaml

    try:
        config = yaml.safe_load(run.config_text)
    except yaml.YAMLError:
        return None
    return (config.get("trainer") or {}).get("max_steps") if isinstance(config, dict) else None


def render(run: Run, caps: Caps) -> str:
    """The page's HTML."""
    from grouprl.report.template import PAGE

    images = Images(run.dir, caps.images)
    fired = charts.alarm_steps(run.alarms, run.metrics)
    rollouts, rollout_steps_left = rollout_steps(run, caps, images)
    validation, validation_steps_left = validation_steps(run, caps, images)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(PAGE).render(
        title=run.dir.name, run_dir=str(run.dir),
        generated=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"),
        last_step=run.last_step, max_steps=_max_steps(run),
        plotly_js=Markup(charts.plotly_js()),
        charts=[(g, Markup(div)) for g, div in charts.chart_divs(run.metrics, fired)],
        alarms=run.alarms, fired=fired,
        rollouts=rollouts, rollout_steps_left=rollout_steps_left,
        validation=validation, validation_steps_left=validation_steps_left,
        best=run.best, checkpoints=run.checkpoints,
        config_text=run.config_text, info_rows=_info_rows(run),
        bad_lines=run.bad_lines, images_left_out=images.left_out, caps=caps,
    )
