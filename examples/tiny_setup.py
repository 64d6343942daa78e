"""Turn a GPU recipe of examples/ into a CPU run: a tiny Qwen2.5-VL, synthetic data, tiny sizes.

    python examples/tiny_setup.py RECIPE ROOT     # builds under ROOT, prints the overrides, one per line

``examples/run_tiny.sh`` runs ``grouprl train RECIPE <these overrides>``; the tests run the
same. Under ROOT it writes, once:

- ``model/``: a randomly initialised tiny Qwen2.5-VL (same architecture and module names as
  Qwen2.5-VL-3B) with a tokenizer trained on the synthetic reports;
- ``reports/data.json``: synthetic chest X-ray studies in LLaVA format (the EditGRPO task);
- ``vqa/data.jsonl``: the same kind of studies as CheXPO-style VQA in ms-swift format:
  "Which findings are present?", answered with the present findings, comma-separated,
  the report as the reasoning, question type "findings";
- ``math/data.jsonl``: synthetic arithmetic word problems in EasyR1 format, with worked
  solutions ending in ``<answer>\\boxed{N}</answer>`` (``grouprl.domains.reasoning.synthetic_math``), the
  task of recipes with a verifier: the rule verifier checks their boxed answers;
- for flow-matching recipes (``kind: flow``), only when one is run (they need
  ``grouprl[diffusion]``): ``sd3_model/``, a tiny ``StableDiffusion3Pipeline`` directory with
  SD3.5's parts (``grouprl.domains.diffusion.tiny.build_tiny_sd3_pipeline``: two CLIPs and a T5
  text encoder, a VAE, 16 x 16 latents and images), so a recipe's tiny run takes the SD3.5 model's
  path (three-encoder prompts, VAE latents and decoding), and ``ocr/train.txt``, prompts quoting a
  word to render (Flow-GRPO's OCR layout).

The overrides come from ``tiny_overrides.txt`` next to this file: its ``[all]`` lines for
every language recipe (``[flow]`` instead for flow-matching recipes), its ``[reward_server]`` lines for recipes scored by the reward server (they
score in process instead, with the same composite), its ``[online_filtering]`` lines for
recipes with dynamic sampling and its ``[verifier]`` lines for recipes with Guided-GRPO's
verifier (the rule verifier instead of a server). A recipe with a verifier gets the
arithmetic problems; one whose rewards read answers (answer_set_f1, kg_consistency) gets the
VQA data; the others get the reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OVERRIDES_FILE = HERE / "tiny_overrides.txt"
STUDIES = 8
VQA_QUESTION = ("Which findings are present? Reason inside <think></think>, then list the findings, "
                "comma-separated, inside <answer></answer>.")
VQA_REWARDS = {"answer_set_f1", "kg_consistency"}
DATA_FILES = {"reports": "reports/data.json", "vqa": "vqa/data.jsonl", "math": "math/data.jsonl",
              "ocr": "ocr/train.txt"}  # per task, under ROOT
MODELS = {"ocr": "sd3_model"}  # the tiny model of a task, under ROOT (default: model)
OCR_WORDS = ("HELLO", "grouprl", "STOP", "OPEN 24", "EXIT", "CAFE", "RL", "GRPO")
NO_FINDING = "no finding"


def build(root: str | Path, *, seed: int = 0) -> dict[str, Path]:
    """Write the tiny model and both datasets under ``root`` (kept when already there)."""
    from grouprl.domains.radiology.synthetic.cxr import corpus, write_dataset

    root = Path(root)
    paths = {"model": root / "model", **{task: root / file for task, file in DATA_FILES.items()}}
    if not paths["reports"].exists():
        write_dataset(paths["reports"].parent, STUDIES, seed=seed, format="llava")
    if not paths["vqa"].exists():
        write_vqa(paths["vqa"], STUDIES, seed=seed + 1)
    if not paths["math"].exists():
        from grouprl.domains.reasoning import synthetic_math

        synthetic_math.write_dataset(paths["math"], synthetic_math.generate_problems(STUDIES, seed=seed + 2))
    if not (paths["model"] / "config.json").exists():
        from grouprl.domains.radiology.synthetic.cxr import FINDINGS
        from grouprl.models.tiny import build_tiny_vlm

        text = corpus() + [VQA_QUESTION, "<think>", "</think>", "<answer>", "</answer>", NO_FINDING]
        text += [finding_label(name) for name in FINDINGS]
        build_tiny_vlm(paths["model"], text, seed=seed, vocab_size=1024)
    return paths


def build_flow(root: str | Path, *, seed: int = 0) -> dict[str, Path]:
    """The flow-matching recipes' tiny model and OCR prompts under ``root`` (kept when already there)."""
    root = Path(root)
    paths = {"model": root / MODELS["ocr"], "ocr": root / DATA_FILES["ocr"]}
    if not paths["ocr"].exists():
        paths["ocr"].parent.mkdir(parents=True, exist_ok=True)
        paths["ocr"].write_text("".join(f'A sign that says "{word}"\n' for word in OCR_WORDS))
    if not (paths["model"] / "model_index.json").exists():
        from grouprl.domains.diffusion.tiny import build_tiny_sd3_pipeline

        build_tiny_sd3_pipeline(paths["model"], seed=seed, sample_size=16,
                                corpus=[f'A sign that says "{word}"' for word in OCR_WORDS])
    return paths


def is_flow(recipe: str | Path) -> bool:
    import yaml

    return (yaml.safe_load(Path(recipe).read_text()) or {}).get("kind") == "flow"


def finding_label(name: str) -> str:
    return name.replace("_", " ")


def write_vqa(path: str | Path, n: int, *, seed: int) -> Path:
    """CheXPO-style VQA records (ms-swift format) about ``n`` synthetic studies."""
    from grouprl.domains.radiology.synthetic.cxr import write_dataset
    from grouprl.files import write_text_atomic

    path = Path(path)
    # the studies' images and reports, in LLaVA form, then re-dressed as questions
    studies = json.loads(write_dataset(path.parent, n, seed=seed, format="llava", name="studies").read_text())
    lines = []
    for study in studies:
        report = study["conversations"][-1]["value"]
        present = [finding_label(k) for k, v in study["findings"].items() if v == 1]
        answer = ", ".join(present) or NO_FINDING
        lines.append(json.dumps({
            "id": study["id"],
            "messages": [{"role": "user", "content": "<image>" + VQA_QUESTION}],
            "images": [study["image"]],
            "solution": f"<think>{report}</think><answer>{answer}</answer>",
            "answer": answer,
            "reasoning": report,
            "question_type": "findings",
        }) + "\n")
    write_text_atomic(path, "".join(lines))
    return path


def read_sections(path: Path = OVERRIDES_FILE) -> dict[str, list[str]]:
    """``{section: [override, ...]}`` of tiny_overrides.txt (``#`` comments and blank lines skipped)."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif current is None:
            raise ValueError(f"{path}: {line!r} comes before any [section]")
        else:
            current.append(line)
    return sections


def task_of(recipe: str | Path) -> str:
    """``ocr`` for a flow-matching recipe, ``math`` for one with a verifier, ``vqa`` for one whose rewards
    read answers, else ``reports``."""
    from grouprl.config import load_config

    if is_flow(recipe):
        return "ocr"
    config = load_config(recipe)
    if config.worker.rollout.verifier.enable:
        return "math"
    names = {f.name for f in config.worker.reward.functions}
    return "vqa" if names & VQA_REWARDS else "reports"


def overrides(recipe: str | Path, root: str | Path, out: str | Path | None = None) -> list[str]:
    """The dotted overrides that run ``recipe`` on the tiny model and data under ``root``."""
    from grouprl.config import load_config

    root = Path(root).resolve()
    out = Path(out) if out is not None else root / "runs" / Path(recipe).stem
    task = task_of(recipe)
    values = {"@MODEL@": str(root / MODELS.get(task, "model")), "@DATA@": str(root / DATA_FILES[task]),
              "@OUT@": str(Path(out).resolve())}
    sections = read_sections()
    if is_flow(recipe):
        return [_fill(line, values) for line in sections["flow"]]
    config = load_config(recipe)
    lines = list(sections["all"])
    if config.worker.reward.reward_server:
        lines += sections["reward_server"]
    if config.algorithm.online_filtering:
        lines += sections["online_filtering"]
    if config.worker.rollout.verifier.enable:
        lines += sections["verifier"]
    return [_fill(line, values) for line in lines]


def _fill(line: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        line = line.replace(key, value)
    return line


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python examples/tiny_setup.py RECIPE ROOT", file=sys.stderr)
        return 2
    recipe, root = argv
    build_flow(root) if is_flow(recipe) else build(root)
    print("\n".join(overrides(recipe, root)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
