"""The verifier's parsing, the local backend's plumbing, its config.

The rule backend (Guided-GRPO's): tests/reasoning/test_rule_verifier.py.
"""

from __future__ import annotations

import pytest

from grouprl.config import ConfigError, VerifierConfig, config_from_dict, to_dict
from grouprl.rollout.verifier import (
    LocalVerifier,
    VerifierRequest,
    build_verifier,
    clean_reply,
    has_final_answer,
    is_stop,
    parse_hallucination_score,
    verifier_messages,
)

PROBLEM = "[IMAGE]\nA shop sells 3 apples for 4 dollars. How much do 12 apples cost, in dollars?"


# ---------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("turn, expected", [
    ("12/3 = 4 groups, 4*4 = 16. <answer>\\boxed{16}</answer>", True),
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", True),  # nested braces are one box
    ("<answer>\\boxed{1}</answer> and again <answer>\\boxed{1}</answer>", False),  # two <answer>
    ("<answer>\\boxed{1} or \\boxed{2}</answer>", False),  # two \boxed
    ("<answer>\\boxed{1} \\boxed{</answer>", False),  # a second box left open
    ("The answer is 16.", False),  # none
    ("\\boxed{16}", False),  # a box without <answer>
    ("<answer>16</answer>", False),  # <answer> without a box
    ("<answer>\\boxed{ }</answer>", False),  # an empty box
    ("</answer>\\boxed{16}<answer>", False),  # tags the wrong way round
])
def test_has_final_answer(turn, expected):
    assert has_final_answer(turn) is expected


@pytest.mark.parametrize("text, expected", [
    ("Good.\n[SCORE] hallucination_detect=1", 1.0),
    ("Wrong value.\n[SCORE]  hallucination_detect = 0", 0.0),
    ("no score here", None),
    ("[SCORE] hallucination_detect=2", None),
    # the last score line is the verdict; an earlier quote of the instruction is not
    ("You should write [SCORE] hallucination_detect=0|1 ... fine.\n[SCORE] hallucination_detect=1", 1.0),
    ("", None),
])
def test_parse_hallucination_score(text, expected):
    assert parse_hallucination_score(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("###STOP###", True),
    ("  ###STOP###  \n", True),
    ("###STOP### the answer is right", True),
    ("", True),
    ("   \n\t", True),
    ("...!?", True),  # no letter or digit
    ("---\n***", True),
    ("Correct. Now find the total cost?", False),
    ("7", False),
    ("Not yet ###STOP###", False),  # the token only counts at the start
])
def test_is_stop(text, expected):
    assert is_stop(text, "###STOP###") is expected


def test_is_stop_uses_the_configured_token():
    assert is_stop("<END>", "<END>") and not is_stop("###STOP###", "<END>")


def test_clean_reply_strips_and_drops_a_leading_user_label():
    assert clean_reply("  User: Check step 2.\n") == "Check step 2."
    assert clean_reply("Check the User: label") == "Check the User: label"
    assert clean_reply("User:") == ""


def test_verifier_messages_layout():
    messages = verifier_messages("TEMPLATE", VerifierRequest(PROBLEM, None, ["first turn", "second turn"]))
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == "TEMPLATE"
    user = messages[1]["content"]
    problem_at, reference_at, history_at = (user.index(s) for s in
                                            ("### Problem Statement", "### Reference Answer", "### Conversation History"))
    assert problem_at < reference_at < history_at
    assert "[IMAGE]" in user[problem_at:reference_at]
    assert user[reference_at:history_at].split("\n")[1] == "N/A"
    assert "Assistant: first turn\nAssistant: second turn" in user  # the seed joins turns by one newline
    assert user.endswith("\n\nProvide the next piece of guidance following the rules above.")


# ---------------------------------------------------------------------------- the local backend


@pytest.fixture(scope="module")
def tiny_verifier_dir(tmp_path_factory):
    from grouprl.models.tiny import build_tiny_text_lm

    corpus = ["### Problem Statement", "### Reference Answer", "### Conversation History", "Assistant:",
              "Correct. What is the next step?", "###STOP###", "[SCORE] hallucination_detect=1", PROBLEM]
    return build_tiny_text_lm(tmp_path_factory.mktemp("verifier") / "model", corpus, seed=0)


def test_local_verifier_renders_generates_and_parses(tiny_verifier_dir):
    config = VerifierConfig(backend="local", model_path=str(tiny_verifier_dir), max_tokens=6, temperature=0.7,
                            top_p=0.9, top_k=20)
    verifier = build_verifier(config)
    assert isinstance(verifier, LocalVerifier) and verifier.backend == "local"
    request = VerifierRequest(PROBLEM, None, ["Step 1: 12/3 = 4."])
    prompt = verifier.render(request)
    # the checkpoint's own chat template around the verifier's messages
    assert prompt.startswith("<|im_start|>system\n" + config.prompt_template)
    assert "### Reference Answer\nN/A" in prompt and "Assistant: Step 1: 12/3 = 4." in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    s = verifier.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.7, 0.9, 20, 6)
    replies = verifier.reply_many([request, VerifierRequest(PROBLEM, "16", ["a", "b"])])
    assert len(replies) == 2 and verifier.requests == 2
    for out in replies:
        assert isinstance(out.text, str) and not out.failed
        assert 1 <= out.tokens <= 6
        assert out.stop == is_stop(out.text, config.stop_token)
        assert out.score == parse_hallucination_score(out.text)
        assert out.latency_s > 0
    verifier.close()


# ---------------------------------------------------------------------------- configuration


def verifier_config(**values) -> dict:
    return {"worker": {"rollout": {"verifier": values}}}


def test_defaults_and_backend_resolution():
    v = config_from_dict({}).worker.rollout.verifier
    assert not v.enable and v.max_turns == 20 and v.stop_token == "###STOP###" and v.train_scope == "full_turn"
    assert v.stop_token in v.prompt_template and "[SCORE] hallucination_detect=" in v.prompt_template
    assert v.resolved_backend == "local"
    assert VerifierConfig(use_http=True).resolved_backend == "http"
    assert VerifierConfig(backend="rule").resolved_backend == "rule"
    # a disabled verifier's half-filled backend settings do not stop a run
    config_from_dict(verifier_config(backend="http"))


@pytest.mark.parametrize("values, key", [
    ({"enable": True, "backend": "http", "model": "m"}, "worker.rollout.verifier.base_url"),
    ({"enable": True, "use_http": True, "model": "m"}, "worker.rollout.verifier.base_url"),
    ({"enable": True, "backend": "http", "base_url": "host:8000/v1", "model": "m"}, "worker.rollout.verifier.base_url"),
    ({"enable": True, "backend": "http", "base_url": "http://h/v1"}, "worker.rollout.verifier.model"),
    ({"enable": True}, "worker.rollout.verifier.model_path"),
    ({"max_turns": 0}, "worker.rollout.verifier.max_turns"),
    ({"top_p": 0.0}, "worker.rollout.verifier.top_p"),
    ({"top_p": 1.5}, "worker.rollout.verifier.top_p"),
    ({"top_k": -2}, "worker.rollout.verifier.top_k"),
    ({"temperature": -1}, "worker.rollout.verifier.temperature"),
    ({"max_tokens": 0}, "worker.rollout.verifier.max_tokens"),
    ({"timeout": 0}, "worker.rollout.verifier.timeout"),
    ({"max_retries": -1}, "worker.rollout.verifier.max_retries"),
    ({"http_concurrency": 0}, "worker.rollout.verifier.http_concurrency"),
    ({"stop_token": " "}, "worker.rollout.verifier.stop_token"),
    ({"backend": "local", "use_http": True}, "worker.rollout.verifier.use_http"),
    ({"enable": True, "backend": "rule", "stop_token": "<END>"}, "worker.rollout.verifier.prompt_template"),
    ({"backend": "grpc"}, "worker.rollout.verifier.backend"),
    ({"train_scope": "every_turn"}, "worker.rollout.verifier.train_scope"),
    ({"on_failure": "ignore"}, "worker.rollout.verifier.on_failure"),
    ({"max_turn": 3}, "worker.rollout.verifier.max_turn"),
])
def test_bad_settings_name_their_key(values, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict(verifier_config(**values))


def test_build_checks_what_the_backend_needs_even_when_disabled():
    with pytest.raises(ConfigError, match=r"worker\.rollout\.verifier\.base_url"):
        build_verifier(VerifierConfig(backend="http", model="m"))
    with pytest.raises(ConfigError, match=r"worker\.rollout\.verifier\.model_path"):
        build_verifier(VerifierConfig())


def test_the_environment_key_is_read_at_build_time_and_never_saved(monkeypatch):
    monkeypatch.setenv("GROUPRL_VERIFIER_API_KEY", "sk-from-env")
    config = config_from_dict(verifier_config(enable=True, backend="http", base_url="http://127.0.0.1:1/v1",
                                              model="m"))
    verifier = build_verifier(config.worker.rollout.verifier)
    assert verifier.api_key == "sk-from-env"
    assert "sk-from-env" not in repr(verifier) and "sk-from-env" not in str(to_dict(config))
    assert "api_key" not in repr(config.worker.rollout.verifier)
    verifier.close()
