"""The report page's Jinja2 template (kept in Python so that it ships inside the package)."""

PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>grouprl report: {{ title }}</title>
<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1400px;
       padding: 0 1.2em 3em; color: #222; }
h1 { margin-bottom: 0.1em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
nav a { margin-right: 1em; } .muted, .note { color: #666; font-size: 0.9em; }
.missing { color: #a60; font-size: 0.85em; }
table { border-collapse: collapse; } td, th { border: 1px solid #ddd; padding: 3px 6px; vertical-align: top;
  font-size: 0.9em; text-align: left; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font-size: 0.88em; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(620px, 1fr)); gap: 0.6em; }
.chart { border: 1px solid #eee; }
.alarm { color: #b00; }
.group { border: 1px solid #ccc; border-radius: 4px; margin: 0.8em 0; padding: 0.5em; }
.prompt { background: #f6f8fa; padding: 0.4em; margin-bottom: 0.4em; }
.label { font-weight: 600; font-size: 0.8em; color: #555; margin-top: 0.2em; }
.completions { width: 100%; } td.text { width: 70%; } .flags { color: #a60; }
.thumbs img, img.prompt-image { max-height: 160px; margin: 0.2em; }
img.sample-image { max-height: 160px; } img.grid { max-width: 100%; }
.turn { margin: 0.2em 0 0.2em 1em; padding: 0.2em 0.4em; border-left: 3px solid #4a7; }
.turn.verifier { border-left-color: #d83; background: #fff8f0; } .who { font-size: 0.8em; color: #555; }
.turn.tool { border-left-color: #57c; background: #f3f6ff; }
.turn.environment { border-left-color: #a5c; background: #faf5ff; }
.calls { margin: 0.2em 0; padding-left: 1.4em; font-size: 0.88em; } .call.malformed { color: #b00; }
.tool-name { font-weight: 600; } .result .tool-name { font-size: 0.8em; color: #335; }
.edit .before { background: #fee; text-decoration: line-through; } .edit .after { background: #efe; }
.extras span { margin-right: 1em; font-size: 0.85em; color: #444; }
.view { margin-top: 0.3em; }
</style>
<script>{{ plotly_js }}</script>
</head>
<body>
<h1>grouprl run report: {{ title }}</h1>
<div class="muted">{{ run_dir }} &middot; written {{ generated }} &middot;
  {% if last_step is not none %}last logged step {{ last_step }}{% if max_steps %} of {{ max_steps }}{% endif %}{% else %}no step logged yet{% endif %}
  &middot; run <code>grouprl report</code> again to refresh</div>
<nav><a href="#alarms">alarms</a><a href="#curves">curves</a><a href="#rollouts">rollouts</a>
<a href="#validation">validation</a><a href="#checkpoints">checkpoints</a><a href="#config">config</a></nav>
{% if bad_lines %}<p class="missing">Lines left out as unreadable:
  {% for name, n in bad_lines.items() %}{{ name }}: {{ n }}{% if not loop.last %}, {% endif %}{% endfor %}</p>{% endif %}

<h2 id="alarms">Health alarms</h2>
{% if alarms %}
<table><tr><th>step</th><th>alarm</th><th>message</th></tr>
{% for a in alarms %}<tr class="alarm"><td>{{ a.step }}</td><td>{{ a.alarm }}</td><td>{{ a.message }}</td></tr>{% endfor %}
</table>
{% elif fired %}
<table><tr><th>step</th><th>alarms (from health/ metrics)</th></tr>
{% for step, names in fired.items() %}<tr class="alarm"><td>{{ step }}</td><td>{{ names|join(", ") }}</td></tr>{% endfor %}
</table>
{% else %}<p>No alarm fired.</p>{% endif %}

<h2 id="curves">Curves</h2>
<p class="note">Training (solid) and validation (dashed, <code>val/</code>) on one step axis, one chart per metric group;
  dotted red lines: health alarms. Click a legend entry to show or hide a curve (spreads start hidden).</p>
{% if charts %}<div class="charts">{% for group, div in charts %}<div class="chart" data-group="{{ group }}">{{ div }}</div>{% endfor %}</div>
{% else %}<p>No metrics logged yet.</p>{% endif %}

<h2 id="rollouts">Rollouts</h2>
{% if rollouts %}
<label>step <select class="step-select" data-target="rollout-steps">
{% for s in rollouts %}<option value="{{ s.step }}"{% if loop.last %} selected{% endif %}>{{ s.step }}</option>{% endfor %}
</select></label>
{% if rollout_steps_left %}<span class="note">{{ rollouts|length }} of {{ rollouts|length + rollout_steps_left }} logged steps embedded; {{ rollout_steps_left }} left out (cap: {{ caps.steps }}, --max-steps)</span>{% endif %}
<div id="rollout-steps">{% for s in rollouts %}<div class="step" data-step="{{ s.step }}"><p class="note">step {{ s.step }}: {{ s.note }}</p>{{ s.html }}</div>{% endfor %}</div>
{% else %}<p>No rollouts logged (rollouts.jsonl is absent or empty; <code>trainer.log_rollouts</code>).</p>{% endif %}

<h2 id="validation">Validation generations</h2>
{% if validation %}
<label>step <select class="step-select" data-target="validation-steps">
{% for s in validation %}<option value="{{ s.step }}"{% if loop.last %} selected{% endif %}>{{ s.step }}</option>{% endfor %}
</select></label>
{% if validation_steps_left %}<span class="note">{{ validation|length }} of {{ validation|length + validation_steps_left }} validations embedded; {{ validation_steps_left }} left out (--max-steps)</span>{% endif %}
<div id="validation-steps">{% for s in validation %}<div class="step" data-step="{{ s.step }}"><p class="note">step {{ s.step }}: {{ s.note }}</p>{{ s.html }}</div>{% endfor %}</div>
{% else %}<p>No validation generations logged.</p>{% endif %}
{% if images_left_out %}<p class="missing">{{ images_left_out }} images left out (cap: {{ caps.images }}, --max-images).</p>{% endif %}

<h2 id="checkpoints">Checkpoints</h2>
{% if best %}<p><b>Best checkpoint</b>: step {{ best.get("step", "?") }}, {{ best.get("metric", "?") }} = {{ best.get("value", "?") }} ({{ best.get("mode", "?") }}) &middot; <code>{{ best.get("path", "") }}</code></p>
{% else %}<p><b>Best checkpoint</b>: none (no <code>trainer.best_metric</code>, or no validation yet).</p>{% endif %}
{% if checkpoints %}<table><tr><th>checkpoint</th><th>global step</th><th>epoch</th></tr>
{% for name, state in checkpoints %}<tr><td>{{ name }}</td><td>{{ state.get("global_step", "?") }}</td><td>{{ state.get("epoch", "?") }}</td></tr>{% endfor %}
</table>{% else %}<p>No checkpoint saved yet.</p>{% endif %}

<h2 id="config">Config and run info</h2>
{% if info_rows %}<table>{% for k, v in info_rows %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</table>{% endif %}
{% if config_text is not none %}<details><summary>config.yaml</summary><pre>{{ config_text }}</pre></details>{% else %}<p>No config.yaml.</p>{% endif %}

<script>
// step selectors: show the chosen step's block, hide the others
document.querySelectorAll("select.step-select").forEach(function (select) {
  var box = document.getElementById(select.dataset.target);
  function show() {
    box.querySelectorAll(":scope > .step").forEach(function (d) { d.hidden = d.dataset.step !== select.value; });
  }
  select.addEventListener("change", show);
  show();
});
</script>
</body>
</html>
"""
