#!/usr/bin/env bash
# Run a recipe of examples/ on a CPU: a tiny Qwen2.5-VL, synthetic chest X-rays, two steps.
#
#   examples/run_tiny.sh examples/editgrpo_qwen25vl3b.yaml [more overrides...]
#   TINY_DIR=/tmp/tiny examples/run_tiny.sh examples/chexpo_v2.yaml trainer.max_steps=5
#
# The model and the data are built once under $TINY_DIR (default runs/tiny); the run goes to
# $TINY_DIR/runs/<recipe name>. The overrides are those of examples/tiny_overrides.txt
# (printed before the run); extra arguments are more overrides and come last, so they win.
# $PYTHON picks the interpreter (default: python).
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 RECIPE.yaml [key=value ...]" >&2
    exit 2
fi
recipe=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=${TINY_DIR:-runs/tiny}
python=${PYTHON:-python}

overrides_text=$("$python" "$here/tiny_setup.py" "$recipe" "$root")
mapfile -t overrides <<< "$overrides_text"
printf 'grouprl train %s' "$recipe"
printf ' %q' "${overrides[@]}" "$@"
printf '\n'
exec "$python" -m grouprl train "$recipe" "${overrides[@]}" "$@"
