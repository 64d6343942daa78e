"""Guided-GRPO behaves as the seed (tongruiliu/Guided-GRPO) where no document says otherwise (issue 21 item 2).

Each test names the seed code it follows (verl/workers/rollout/vllm_rollout_spmd.py,
verl/workers/rollout/config.py, examples/reward_function/math.py, examples/config_multi_turn*.yaml).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from PIL import Image

from grouprl.config import DEFAULT_VERIFIER_TEMPLATE, ConfigError, VerifierConfig, load_config
from grouprl.data.sample import Sample
from grouprl.models.inputs import end_of_turn_id
from grouprl.rewards import get_reward
from grouprl.rewards.rule_based import has_final_answer
from grouprl.rollout.engine import SamplingParams
from grouprl.rollout.multiturn import (TEMPLATE_TOKENS_PER_TURN, dialogue_response_budget, problem_text,
                                      turn_boundary_ids)
from grouprl.rollout.verifier import VerifierRequest, build_verifier, clean_reply, is_stop, verifier_messages

from test_engine import text_samples  # helpers (`paths`: tests/conftest.py)
from test_multiturn import ScriptedVerifier, rollout
from grouprl.models.loading import load_model_and_processor
from grouprl.rollout.hf_engine import HFGenerationEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "guided_grpo_qwen3vl8b.yaml"


@pytest.fixture(scope="module")
def never_ending(paths):
    """The tiny LM with its end-of-turn token banned: every turn runs to its token limit."""
    model, processor, _ = load_model_and_processor(paths["lm"])
    model.eval()
    engine = HFGenerationEngine(model, processor)
    eot = end_of_turn_id(processor)
    head = model.get_output_embeddings()
    if head.bias is None:
        head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    with torch.no_grad():
        for token in {eot, *engine.eos_token_ids}:
            head.bias[token] = float("-inf")
    return processor, engine, eot


# ---------------------------------------------------------------------------- 1. token limits


def test_a_truncated_turn_is_answered_and_the_dialogue_goes_on(never_ending):
    # seed: _generate_multi_turn calls the verifier after every turn, whatever its finish reason
    processor, engine, eot = never_ending
    verifier = ScriptedVerifier({})
    batch = rollout(processor, verifier, max_turns=3).generate(engine, text_samples(),
                                                               SamplingParams(n=2, max_new_tokens=3, seed=1))
    assert bool(batch.truncated.all())
    assert batch.extras["stop_reason"] == ["max_turns"] * len(batch)
    assert batch.extras["num_turns"] == [3] * len(batch)
    assert sorted(len(r.turns) for r in verifier.seen) == sorted([1, 2, 3] * len(batch))
    for dialogue, spans, row in zip(batch.extras["dialogue"], batch.extras["spans"], batch.response_ids):
        # the text after a cut-off turn opens with the end-of-turn token it never sampled
        between = [s for s in spans if s[2] == "between"]
        assert between and all(int(row[start]) == eot for start, _, _ in between)


def test_max_tokens_per_turn_bounds_each_policy_turn(never_ending):
    processor, engine, _ = never_ending
    batch = rollout(processor, ScriptedVerifier({}), max_turns=2, max_tokens_per_turn=2).generate(
        engine, text_samples(), SamplingParams(n=1, max_new_tokens=6, seed=1))
    policy = [end - start for spans in batch.extras["spans"] for start, end, kind in spans if kind == "policy"]
    assert policy and all(n == 2 for n in policy)


@pytest.mark.parametrize("room, turns", [(3, 2), (0, 1)])
def test_max_dialogue_tokens_ends_the_dialogue_as_length(never_ending, room, turns):
    # room: tokens left for the second turn once the first (6 tokens) and the text after it are in
    processor, engine, _ = never_ending
    between = len(turn_boundary_ids(processor, "Go.", after_end_of_turn=False))
    limit = 6 + between + room
    verifier = ScriptedVerifier({1: "Go.", 2: "Go."})
    batch = rollout(processor, verifier, max_turns=10, max_dialogue_tokens=limit).generate(
        engine, text_samples(), SamplingParams(n=1, max_new_tokens=6, seed=1))
    assert batch.extras["stop_reason"] == ["length"] * len(batch)
    assert batch.extras["num_turns"] == [turns] * len(batch)
    # the last turn is cut at the limit; a turn with no room is never started
    assert batch.response_mask.sum(-1).tolist() == [limit if room else 6] * len(batch)
    assert all(spans[-1] == [limit - room, limit, "policy"] if room else spans == [[0, 6, "policy"]]
               for spans in batch.extras["spans"])
    # the last turn was answered like the others (its score counts)
    assert len(verifier.seen) == turns * len(batch)


def test_token_limit_keys_default_to_the_seed_and_size_the_engine():
    config = VerifierConfig()
    assert config.max_tokens_per_turn is None and config.max_dialogue_tokens is None
    between = config.max_tokens + TEMPLATE_TOKENS_PER_TURN
    assert dialogue_response_budget(100, config) == 20 * 100 + 19 * between
    assert dialogue_response_budget(100, VerifierConfig(max_tokens_per_turn=7)) == 20 * 7 + 19 * between
    assert dialogue_response_budget(100, VerifierConfig(max_dialogue_tokens=300)) == 300 + 100
    for key in ("max_tokens_per_turn", "max_dialogue_tokens"):
        with pytest.raises(ConfigError, match=f"'worker.rollout.verifier.{key}'"):
            VerifierConfig(**{key: 0}).check()


# ---------------------------------------------------------------------------- 2. final answers and grading


@pytest.mark.parametrize("turn, final", [
    ("< answer >\\boxed{2}</ answer >", True),  # seed: re.sub(r"\s*(<|>|/)\s*", r"\1", ...) first
    ("<answer>\\boxed{2}< /answer>", True),
    ("<\nanswer\n>\\boxed{2}<\t/\tanswer>", True),
    ("<answer>\\boxed{2}</answer>", True),
    ("< answer >2</ answer >", False),
    ("< answer >\\boxed{2}</ answer > <answer>\\boxed{2}</answer>", False),
])
def test_final_answer_rule_normalises_whitespace_around_tags(turn, final):
    assert has_final_answer(turn) is final


@pytest.mark.parametrize("completion, expected", [
    ("So it is \\boxed{5}.", 0.8 + 0.0 + 0.05),  # seed: accuracy from the last box anywhere, no <answer> needed
    ("\\boxed{4}, no: <answer>\\boxed{5}</answer>", 0.8 + 0.1 + 0.05),
    ("<answer>\\boxed{5}</answer> then \\boxed{6}", 0.0 + 0.1 + 0.05),  # the last box is graded
    ("\\boxed{5} and then \\boxed{5", 0.0 + 0.0 + 0.05),  # the last box left open: nothing to grade
    ("< answer >\\boxed{5}</ answer >", 0.8 + 0.1 + 0.05),
])
def test_guided_reward_grades_the_last_box_anywhere(completion, expected):
    assert get_reward("guided")(["p"], [completion], answer=["5"]) == pytest.approx([expected])


# ---------------------------------------------------------------------------- 3. replies


@pytest.mark.parametrize("reply, stop", [
    ("这一步是正确的", True),  # seed: re.search(r"[A-Za-z0-9]", text) is None -> STOP
    ("Ñandú ñandú", False),  # ASCII letters among them
    ("ÉÈÊ ñ", True),
    ("“…”", True),
    ("步骤 2 正确", False),  # an ASCII digit
    ("Correct. Next?", False),
    ("###STOP###", True),
])
def test_a_reply_without_an_ascii_letter_or_digit_is_stop(reply, stop):
    assert is_stop(clean_reply(reply), "###STOP###") is stop


@pytest.mark.parametrize("reply, cleaned", [
    ("User: Check step 2.", "Check step 2."),
    ("user: Check step 2.", "Check step 2."),  # seed: text.lower().startswith("user:")
    ("USER:Check step 2.", "Check step 2."),
    ("  uSeR:   Check step 2.  ", "Check step 2."),
    ("Users: Check step 2.", "Users: Check step 2."),
])
def test_a_leading_user_label_is_stripped_in_any_case(reply, cleaned):
    assert clean_reply(reply) == cleaned


# ---------------------------------------------------------------------------- 4. what the verifier reads


def _sample(content) -> Sample:
    images = [Image.new("RGB", (8, 8)) for item in content if isinstance(item, dict) and item["type"] == "image"] \
        if isinstance(content, list) else []
    return Sample(messages=[{"role": "user", "content": content}], images=images)


@pytest.mark.parametrize("content, text", [
    ([{"type": "image"}, {"type": "text", "text": "Find x."}], "[IMAGE]\nFind x."),  # seed: "\n".join(parts)
    ([{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which?"}], "[IMAGE]\n[IMAGE]\nWhich?"),
    ([{"type": "text", "text": "A"}, {"type": "text", "text": ""}, {"type": "text", "text": "B"}], "A\nB"),
    ("  plain text  ", "  plain text  "),
])
def test_problem_text_joins_parts_as_the_seed(content, text):
    assert problem_text(_sample(content)) == text


@pytest.mark.parametrize("reference, shown", [("42", "42"), (None, "N/A"), ("", "N/A")])
def test_verifier_user_message_is_the_seeds(reference, shown):
    # seed: _build_verifier_prompts and _format_conversation_for_verifier
    messages = verifier_messages("T", VerifierRequest("[IMAGE]\nFind x.\n", reference, [" a = 1 \n", "b = 2"]))
    assert messages == [
        {"role": "system", "content": "T"},
        {"role": "user", "content": "### Problem Statement\n[IMAGE]\nFind x.\n\n\n"
                                    f"### Reference Answer\n{shown}\n\n"
                                    "### Conversation History\nAssistant: a = 1\nAssistant: b = 2\n\n"
                                    "Provide the next piece of guidance following the rules above."},
    ]


def test_max_turns_defaults_to_the_seeds_and_the_example_keeps_its_settings():
    assert VerifierConfig().max_turns == 20  # seed: VerifierConfig.max_turns = 20
    verifier = load_config(EXAMPLE).worker.rollout.verifier
    assert verifier.max_turns == 10  # seed: examples/config_multi_turn*.yaml
    assert verifier.temperature == 0.0  # seed: examples/config_multi_turn_http.yaml
    assert verifier.top_p == 0.95 and verifier.max_tokens == 256


# ---------------------------------------------------------------------------- 5. the verifier's prompt


def _http(**extra) -> VerifierConfig:
    return VerifierConfig(enable=True, use_http=True, base_url="http://127.0.0.1:9/v1", **extra)


def test_prompt_template_file_is_the_system_message(tmp_path):
    pytest.importorskip("openai")
    path = tmp_path / "teacher.txt"
    path.write_text("Teach briefly. Send ###STOP### once the answer is right.\n", encoding="utf-8")
    verifier = build_verifier(_http(model="teacher", prompt_template_file=str(path)))
    try:
        body = verifier.payload(VerifierRequest("p", "1", ["t"]))
        assert body["messages"][0] == {"role": "system", "content": path.read_text(encoding="utf-8")}
    finally:
        verifier.close()


@pytest.mark.parametrize("content, match", [
    (None, "cannot read"),
    ("", "is empty"),
    ("No stop token here.", "never mentions the stop token"),
])
def test_an_unusable_prompt_template_file_names_the_key(tmp_path, content, match):
    path = tmp_path / "teacher.txt"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=f"'worker.rollout.verifier.prompt_template_file'.*{match}") as info:
        build_verifier(_http(model="teacher", prompt_template_file=str(path)))
    assert "\n" not in str(info.value)


def test_prompt_template_and_its_file_are_not_both_set(tmp_path):
    with pytest.raises(ConfigError, match="'worker.rollout.verifier.prompt_template_file'.*set one"):
        VerifierConfig(prompt_template="x ###STOP###", prompt_template_file=str(tmp_path / "t.txt")).check()


@pytest.mark.parametrize("template_file, warned", [(False, True), (True, False)])
def test_published_verifier_with_the_default_template_warns_once(tmp_path, caplog, template_file, warned):
    pytest.importorskip("openai")
    extra = {}
    if template_file:
        path = tmp_path / "teacher.txt"
        path.write_text("The seed's teacher. ###STOP###", encoding="utf-8")
        extra["prompt_template_file"] = str(path)
    with caplog.at_level(logging.WARNING, logger="grouprl.rollout.verifier"):
        verifier = build_verifier(_http(model="ruitongl/Guided-Verifier-8B", **extra))
        verifier.close()
    hits = [r for r in caplog.records if "prompt_template_file" in r.getMessage()]
    assert len(hits) == (1 if warned else 0)
    assert (verifier.prompt_template == DEFAULT_VERIFIER_TEMPLATE) is warned
