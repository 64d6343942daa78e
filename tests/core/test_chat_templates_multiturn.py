"""Guided-GRPO dialogues under the published Qwen chat templates, chat template kwargs included.

The templates are the models' own (``chat_templates/*.jinja``, each naming where it came from),
put on tiny tokenizers and processors. A scripted engine samples known ids, so the trained
sequence can be compared token for token with what was sampled and what the template writes
between turns; the expected text between turns is written out here, not derived from the code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from grouprl.data.loading import samples_from_records
from grouprl.models.inputs import encode_prompts, end_of_turn_id, left_pad, render_prompt, tokenizer_of
from grouprl.models.tiny import build_tokenizer
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.engine import SamplingParams
from grouprl.rollout.multiturn import turn_boundary_ids

from test_engine import with_eos_bias  # helpers (`paths`, `text_task`: tests/conftest.py)
from test_multiturn import ScriptedVerifier, guided_config, rollout

TEMPLATES = Path(__file__).parent / "chat_templates"
TEXT_TEMPLATES = ("Qwen2.5-Instruct", "Qwen3")
PROBLEM = "What is 2 plus 3?"
REPLIES = ("Check the sum again.", "Closer. Answer in the box format.")
NO_THINKING = {"enable_thinking": False}
EMPTY_THINK = "<think>\n\n</think>\n\n"
# what the policy samples, turn by turn (its end-of-turn token follows each)
TURNS = {
    "thinking": ["<think>\nTwo and three.\n</think>\n\nIt is 6.", "<think>\nRecount.\n</think>\n\nIt is 5.",
                 "<think>\nSure.\n</think>\n\n<answer>\\boxed{5}</answer>"],
    "plain": ["It is 6.", "It is 5.", "<answer>\\boxed{5}</answer>"],
}

# (template, chat template kwargs): every template, and Qwen3 with thinking on (its default) and off
CASES = [("Qwen2.5-Instruct", {}), ("Qwen3", {}), ("Qwen3", NO_THINKING), ("Qwen2.5-VL", {}), ("Qwen3-VL", {})]


def template_text(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def between_turns(name: str, reply: str, kwargs: dict) -> str:
    """What the template writes after an assistant turn's text when ``reply`` follows as a user turn."""
    think = EMPTY_THINK if name == "Qwen3" and kwargs.get("enable_thinking") is False else ""
    return f"<|im_end|>\n<|im_start|>user\n{reply}<|im_end|>\n<|im_start|>assistant\n{think}"


@pytest.fixture(scope="module")
def processors(paths):
    """``processors(name)``: a tiny tokenizer (text templates; Qwen's <think> tokens added) or the tiny
    Qwen2.5-VL processor (VL templates), carrying that published template."""
    from transformers import AutoProcessor

    def make(name: str):
        if name in TEXT_TEMPLATES:
            processor = build_tokenizer([PROBLEM, *REPLIES, *TURNS["thinking"]])
            processor.add_tokens(["<think>", "</think>"], special_tokens=True)
        else:
            processor = AutoProcessor.from_pretrained(paths["vlm"])
        processor.chat_template = template_text(name)
        return processor

    return make


def problem_samples(name: str, kwargs: dict):
    """One sample as the loader makes it (content items; a picture for the VL templates), with ``kwargs``."""
    record = {"problem": PROBLEM, "answer": "5"}
    if name not in TEXT_TEMPLATES:
        picture = Image.new("RGB", (56, 56), (200, 30, 30))
        record = {"problem": "<image>" + PROBLEM, "answer": "5", "images": [picture]}
    return list(samples_from_records([record], chat_template_kwargs=kwargs))


class ScriptedEngine:
    """Samples the scripted turns, one per call, as token ids (the end-of-turn token after each),
    and keeps the ids every call continued from."""

    def __init__(self, processor, turns: list[str]):
        self.processor = processor
        tokenizer = tokenizer_of(processor)
        self.texts = turns
        end = end_of_turn_id(processor)
        self.turns = [tokenizer(t, add_special_tokens=False)["input_ids"] + [end] for t in turns]
        self.contexts: list[list[torch.Tensor]] = []

    def generate(self, samples, params, prompts=None) -> RolloutBatch:
        if prompts is None:
            ids, mask, inputs = encode_prompts(self.processor, samples)
            rows = [ids[i][mask[i].bool()] for i in range(len(samples))]
        else:
            rows, inputs = [p.ids for p in prompts], [p.model_inputs for p in prompts]
        turn = len(self.contexts)
        self.contexts.append(rows)
        prompt_ids, prompt_mask = left_pad(rows, tokenizer_of(self.processor).pad_token_id)
        response = torch.tensor([self.turns[turn]] * len(rows), dtype=torch.long)
        return RolloutBatch(samples=list(samples), group_index=torch.arange(len(samples)), prompt_ids=prompt_ids,
                            prompt_mask=prompt_mask, response_ids=response, response_mask=torch.ones_like(response),
                            responses=[self.texts[turn]] * len(rows),
                            truncated=torch.zeros(len(rows), dtype=torch.bool),
                            model_inputs=list(inputs))


@pytest.mark.parametrize("name,kwargs", CASES, ids=lambda v: v if isinstance(v, str) else json.dumps(v))
def test_a_three_turn_dialogue_is_trained_on_what_was_sampled_and_what_the_template_writes(processors, name, kwargs):
    processor = processors(name)
    tokenizer = tokenizer_of(processor)
    thinking = name == "Qwen3" and kwargs.get("enable_thinking") is not False
    engine = ScriptedEngine(processor, TURNS["thinking" if thinking else "plain"])
    verifier = ScriptedVerifier({1: REPLIES[0], 2: REPLIES[1], 3: "###STOP###"})
    samples = problem_samples(name, kwargs)
    batch = rollout(processor, verifier, max_turns=3).generate(engine, samples, SamplingParams(n=1, max_new_tokens=64))
    assert batch.extras["num_turns"] == [3] and batch.extras["stop_reason"] == ["stop"]

    # the text between turns is what the template writes after an assistant turn (the sampled
    # end-of-turn token not repeated), with the sample's chat template kwargs
    between = [tokenizer(between_turns(name, reply, kwargs)[len("<|im_end|>"):], add_special_tokens=False)["input_ids"]
               for reply in REPLIES]
    sampled = engine.turns
    expected = sampled[0] + between[0] + sampled[1] + between[1] + sampled[2]
    policy = [1] * len(sampled[0]) + [0] * len(between[0]) + [1] * len(sampled[1]) + [0] * len(between[1]) \
        + [1] * len(sampled[2])
    prompt = batch.prompt_ids[0][batch.prompt_mask[0].bool()]
    response = batch.response_ids[0][batch.response_mask[0].bool()]
    assert torch.equal(prompt, engine.contexts[0][0])
    assert response.tolist() == expected
    assert batch.policy_mask[0][batch.response_mask[0].bool()].tolist() == policy
    # each later turn was sampled from exactly the ids it is trained on
    for turn, ends in ((1, len(sampled[0]) + len(between[0])), (2, len(expected) - len(sampled[2]))):
        assert torch.equal(engine.contexts[turn][0], torch.cat([prompt, response[:ends]]))

    # the first prompt is the template's, with the kwargs: for Qwen3 without thinking, the empty think block
    text = tokenizer.decode(prompt.tolist())
    assert text.endswith("<|im_start|>assistant\n" + (EMPTY_THINK if kwargs == NO_THINKING else ""))
    if name in TEXT_TEMPLATES:
        assert f"<|im_start|>user\n{PROBLEM}<|im_end|>\n" in text  # content items given to it as a string
    assert tokenizer.decode(response.tolist()) == (
        engine.texts[0] + between_turns(name, REPLIES[0], kwargs) + engine.texts[1]
        + between_turns(name, REPLIES[1], kwargs) + engine.texts[2] + "<|im_end|>")


@pytest.mark.parametrize("name,kwargs", CASES, ids=lambda v: v if isinstance(v, str) else json.dumps(v))
def test_a_turn_cut_off_gets_its_end_of_turn_token_from_the_template(processors, name, kwargs):
    processor = processors(name)
    tokenizer = tokenizer_of(processor)
    reply = REPLIES[0]
    ended = turn_boundary_ids(processor, reply, after_end_of_turn=True, chat_template_kwargs=kwargs)
    cut = turn_boundary_ids(processor, reply, after_end_of_turn=False, chat_template_kwargs=kwargs)
    assert tokenizer.decode(cut) == between_turns(name, reply, kwargs)
    assert cut == [end_of_turn_id(processor)] + ended


def test_a_template_that_repeats_the_assistant_turn_is_named(processors):
    processor = processors("Qwen2.5-Instruct")
    # writes every message twice: the text after "the" assistant turn is not one thing
    processor.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ m.content }}"
                               "<|im_end|>\n{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match=r"chat template writes an assistant turn's content 2 time\(s\), not once"):
        turn_boundary_ids(processor, "Again.", after_end_of_turn=True)


def test_data_chat_template_kwargs_reach_the_first_prompt_and_a_record_overrides_them(processors, tmp_path):
    from grouprl.config import load_config
    from grouprl.data import load_datasets

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": PROBLEM, "answer": "5"}) + "\n"
                    + json.dumps({"problem": PROBLEM, "answer": "5", "chat_template_kwargs": {"enable_thinking": True}})
                    + "\n")
    processor = processors("Qwen3")
    header = f"<|im_start|>user\n{PROBLEM}<|im_end|>\n<|im_start|>assistant\n"

    cfg = load_config(None, [f"data.train_files=[{data}]"])
    assert cfg.data.chat_template_kwargs == {}
    train, _ = load_datasets(cfg.data)
    assert render_prompt(processor, train[0]) == header  # Qwen3 thinks unless told not to

    cfg = load_config(None, [f"data.train_files=[{data}]", "data.chat_template_kwargs={enable_thinking: false}"])
    train, _ = load_datasets(cfg.data)
    assert train[0].chat_template_kwargs == NO_THINKING
    assert render_prompt(processor, train[0]) == header + EMPTY_THINK
    # the record's own chat_template_kwargs win, key by key, and are not a reward column
    assert train[1].chat_template_kwargs == {"enable_thinking": True}
    assert render_prompt(processor, train[1]) == header
    assert "chat_template_kwargs" not in train[1].columns


def test_a_record_whose_chat_template_kwargs_are_not_an_object_is_named():
    from grouprl.data.formats import DataError

    with pytest.raises(DataError, match=r"record 0: field 'chat_template_kwargs': expected an object"):
        samples_from_records([{"problem": PROBLEM, "answer": "5", "chat_template_kwargs": "enable_thinking=false"}])


def test_a_parquet_column_of_chat_template_kwargs_overrides_only_the_keys_a_row_set(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from grouprl.data.loading import load_samples

    rows = [{"problem": PROBLEM, "answer": "5", "chat_template_kwargs": {"enable_thinking": True}},
            {"problem": PROBLEM, "answer": "5", "chat_template_kwargs": {"add_vision_id": True}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")  # a struct column: each row gets both keys
    samples = load_samples(tmp_path / "train.parquet", chat_template_kwargs=NO_THINKING)
    assert samples[0].chat_template_kwargs == {"enable_thinking": True}
    assert samples[1].chat_template_kwargs == {"enable_thinking": False, "add_vision_id": True}


@pytest.fixture(scope="module")
def sums(text_task):
    """Sums to answer in the box format, and a tiny text LM for them."""
    records = [{"problem": f"What is {a} plus {b}? Answer as <answer>\\\\boxed{{N}}</answer>.", "answer": str(a + b)}
               for a in range(1, 5) for b in range(1, 4)]
    return text_task(records, ["<answer>\\boxed{7}</answer>", "Not yet correct. Try again?"])


def test_guided_training_runs_a_qwen3_policy_without_thinking(sums, tmp_path):
    """The trainer end to end: a text policy saved with Qwen3's template, data.chat_template_kwargs
    turning its thinking off on the first prompt and at every turn boundary."""
    import shutil

    from transformers import AutoTokenizer

    from grouprl.config import config_from_dict
    from grouprl.trainer.grpo import GRPOTrainer

    model = shutil.copytree(sums.model, tmp_path / "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = template_text("Qwen3")
    tokenizer.save_pretrained(model)
    config = guided_config(sums, tmp_path / "run", **{
        "worker.actor.model.model_path": str(model), "data.chat_template_kwargs": NO_THINKING,
        "trainer.max_steps": 1, "trainer.val_freq": -1})
    trainer = GRPOTrainer(config_from_dict(config))
    # turns that end (rather than run out of tokens) go on to the next: the random policy ends them often
    with_eos_bias(trainer.policy, tokenizer.convert_tokens_to_ids("<|im_end|>"), probability=0.3)
    trainer.train()
    batch = trainer.last_step.batch
    for row in range(len(batch)):
        prompt = tokenizer.decode(batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist())
        assert prompt.endswith("<|im_start|>assistant\n" + EMPTY_THINK)
        for start, end, kind in batch.extras["spans"][row]:
            if kind == "between":
                assert tokenizer.decode(batch.response_ids[row, start:end].tolist()).endswith(
                    "<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK)
    assert max(batch.extras["num_turns"]) > 1, "no dialogue went past its first turn"
