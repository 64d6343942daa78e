"""The reward contract, combination, registry/file loading and the built-in rule-based rewards."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap
import threading

import pytest

from grouprl.rewards import (
    RewardError,
    RewardLoadError,
    RewardSet,
    RewardSpec,
    extract_answer,
    extract_boxed,
    get_reward,
    normalize_answer,
    register_reward,
    registered_rewards,
)
from grouprl.config import RewardFunctionConfig
from grouprl.rewards import registry, rule_based

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]


@pytest.fixture
def clean_registry():
    """Registrations made by a test do not leak into the others."""
    # Plugins first: a plugin imported during the test would be dropped by the restore
    # below and, its module being imported already, never register its names again.
    registry.load_plugins()
    before = set(registry.REWARDS.names())
    yield
    for name in set(registry.REWARDS.names()) - before:
        registry.REWARDS.unregister(name)


def by_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def score(funcs, columns=None, prompts=PROMPTS, completions=COMPLETIONS):
    return RewardSet.from_specs(funcs).score(prompts, completions, columns or {})


# ---------------------------------------------------------------- contract


def test_sync_reward_gets_prompts_completions_and_columns_by_keyword():
    seen = {}

    def reward(prompts, completions, *, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, extra=kwargs)
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    result = score([reward], {"answer": ["a", "x", "ccc"], "verifier_score": [0.1, 0.2, 0.3]})
    assert result.components == {"reward": [1.0, 0.0, 1.0]}
    assert result.total == [1.0, 0.0, 1.0]
    assert seen["prompts"] == PROMPTS and seen["completions"] == COMPLETIONS
    # TRL's other call arguments come too (tests/core/test_rewards_trl.py): the set's log functions,
    # and None for what only a trainer knows
    assert callable(seen["extra"].pop("log_extra")) and callable(seen["extra"].pop("log_metric"))
    assert seen["extra"] == {"verifier_score": [0.1, 0.2, 0.3], "completion_ids": None, "trainer_state": None}


def _concurrent_pair():
    # Each reward waits for the other to have started: run one after the other they
    # would time out, so this passes only when they run concurrently.
    a_started, b_started = asyncio.Event(), asyncio.Event()

    async def reward_a(prompts, completions, **kwargs):
        a_started.set()
        await asyncio.wait_for(b_started.wait(), timeout=5)
        return [1.0] * len(completions)

    async def reward_b(prompts, completions, **kwargs):
        b_started.set()
        await asyncio.wait_for(a_started.wait(), timeout=5)
        return [2.0] * len(completions)

    return reward_a, reward_b


def test_async_rewards_run_concurrently_alongside_sync_ones():
    reward_a, reward_b = _concurrent_pair()
    result = score([reward_a, by_length, reward_b])
    assert list(result.components) == ["reward_a", "by_length", "reward_b"]
    assert result.total == [4.0, 5.0, 6.0]


def test_score_works_inside_a_running_event_loop():
    reward_a, reward_b = _concurrent_pair()
    rewards = RewardSet.from_specs([reward_a, reward_b, by_length])

    async def caller():
        return rewards.score(PROMPTS, COMPLETIONS, {})

    assert asyncio.run(caller()).total == [4.0, 5.0, 6.0]


def test_ascore_runs_async_rewards_on_the_callers_loop():
    reward_a, reward_b = _concurrent_pair()
    rewards = RewardSet.from_specs([reward_a, reward_b])
    assert asyncio.run(rewards.ascore(PROMPTS, COMPLETIONS)).total == [3.0, 3.0, 3.0]


def test_weights_combine_and_none_is_skipped(clean_registry):
    @register_reward("_t_sometimes")
    def sometimes(prompts, completions, **kwargs):
        return [None, 1.0, None]

    @register_reward("_t_always")
    def always(prompts, completions, **kwargs):
        return [0.5, 0.5, 0.5]

    result = score([RewardSpec("_t_sometimes", weight=2.0), RewardSpec("_t_always", weight=-0.5)])
    assert result.components == {"_t_sometimes": [None, 1.0, None], "_t_always": [0.5, 0.5, 0.5]}
    assert result.total == pytest.approx([-0.25, 1.75, -0.25])
    assert result.weights == {"_t_sometimes": 2.0, "_t_always": -0.5}
    assert score([sometimes, always]).total == [0.5, 1.5, 0.5]


def test_row_where_every_reward_is_none_is_an_error_naming_the_row():
    def none_on_row_1(prompts, completions, **kwargs):
        return [1.0, None, 0.0]

    def never(prompts, completions, **kwargs):
        return [None] * len(completions)

    with pytest.raises(RewardError, match=r"row 1: every reward returned None \(none_on_row_1, never\)") as err:
        score([none_on_row_1, never])
    assert err.value.row == 1


def test_same_name_twice_gets_indexed_keys():
    result = score([RewardSpec("length", kwargs={"target": 1}), "format", RewardSpec("length", 2.0, {"target": 2})])
    assert list(result.components) == ["length@0", "format", "length@2"]
    assert result.components["length@0"] == [0.0, 0.0, 0.0]  # one word each
    assert result.components["length@2"] == [-0.5, -0.5, -0.5]


# ---------------------------------------------------------------- contract violations


def test_exception_is_wrapped_naming_the_reward():
    def broken(prompts, completions, **kwargs):
        raise KeyError("no such field")

    with pytest.raises(RewardError, match=r"reward 'broken' raised KeyError") as err:
        score([by_length, broken])
    assert isinstance(err.value.__cause__, KeyError)
    assert err.value.reward == "broken"


def test_async_exception_is_wrapped_naming_the_reward():
    async def judge(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        raise ConnectionError("judge server down")

    with pytest.raises(RewardError, match=r"reward 'judge' raised ConnectionError: judge server down"):
        score([by_length, judge])


@pytest.mark.parametrize(
    ("values", "pattern"),
    [
        ([1.0, float("nan"), 0.0], r"reward 'bad' returned nan at row 1"),
        ([1.0, 0.0, float("inf")], r"reward 'bad' returned inf at row 2"),
        ([1.0, "0.5", 0.0], r"reward 'bad' returned a str \('0.5'\) at row 1"),
        ([[1.0], 0.0, 0.0], r"reward 'bad' returned a list \(\[1.0\]\) at row 0"),
        ([1.0, 0.0], r"reward 'bad' returned 2 values for 3 completions \(expected 3, got 2\)"),
        (1.0, r"reward 'bad' returned a float; expected a list of 3 floats"),
        ({"a": 1.0}, r"reward 'bad' returned a dict"),
    ],
)
def test_bad_return_values_are_errors_naming_the_reward(values, pattern):
    def bad(prompts, completions, **kwargs):
        return values

    with pytest.raises(RewardError, match=pattern):
        score([by_length, bad])


def test_numpy_like_scalars_are_accepted():
    class Scalar:  # stands in for numpy scalars / 0-d tensors: anything with __float__
        def __float__(self):
            return 0.25

    def scalars(prompts, completions, **kwargs):
        return [Scalar(), 1, True]

    assert score([scalars]).components["scalars"] == [0.25, 1.0, 1.0]


def test_function_without_var_kwargs_is_rejected_at_load():
    def strict(prompts, completions, answer):
        return [0.0] * len(completions)

    with pytest.raises(RewardLoadError, match=r"reward 'strict' must accept \*\*kwargs"):
        RewardSet.from_specs([strict])


def test_mistyped_option_is_rejected_at_load():
    expected = r"reward 'format' has no option 'stlye'; its named parameters are: style"
    with pytest.raises(RewardLoadError, match=expected):
        RewardSet.from_specs([RewardSpec("format", kwargs={"stlye": "boxed"})])


def test_option_shadowed_by_a_column_is_an_error():
    rewards = RewardSet.from_specs([RewardSpec("format", kwargs={"style": "boxed"})])
    with pytest.raises(RewardError, match=r"reward 'format': option\(s\) \['style'\]"):
        rewards.score(PROMPTS, COMPLETIONS, {"style": ["x", "y", "z"]})


def test_input_shape_errors_name_the_column():
    rewards = RewardSet.from_specs([by_length])
    with pytest.raises(ValueError, match=r"column 'answer' has 2 values for 3 completions"):
        rewards.score(PROMPTS, COMPLETIONS, {"answer": ["a", "b"]})
    with pytest.raises(ValueError, match=r"got 2 prompts for 3 completions"):
        rewards.score(PROMPTS[:2], COMPLETIONS)


def test_spec_validation():
    with pytest.raises(RewardLoadError, match=r"weight must be a number"):
        RewardSpec("format", weight="high")
    with pytest.raises(RewardLoadError, match=r"weight must be finite"):
        RewardSpec("format", weight=float("nan"))
    with pytest.raises(RewardLoadError, match=r"unknown keys \['weigth'\]"):
        RewardSpec.coerce({"name": "format", "weigth": 2})
    assert RewardSpec.coerce({"name": "length", "weight": 3, "kwargs": {"target": 5}}) == RewardSpec(
        "length", 3.0, {"target": 5}
    )
    # a config section's entry (name, weight, kwargs attributes), and on_error as for image rewards
    assert RewardSpec.coerce(RewardFunctionConfig(name="length", weight=2.0, kwargs={"target": 5})) == RewardSpec(
        "length", 2.0, {"target": 5}
    )
    assert RewardSpec.coerce({"name": "format", "on_error": "none"}).on_error == "none"
    with pytest.raises(RewardLoadError, match=r"reward 'format': on_error must be one of raise, none, got 'zero'"):
        RewardSpec("format", on_error="zero")
    with pytest.raises(RewardLoadError, match=r"at least one reward"):
        RewardSet.from_specs([])


def test_on_error_none_leaves_a_failing_rewards_rows_unscored(clean_registry, caplog):
    calls = []

    @register_reward("_t_judge_down")
    def judge_down(prompts, completions, **kwargs):
        calls.append(len(completions))
        raise ConnectionError("judge unreachable")

    rewards = RewardSet.from_specs([{"name": "_t_judge_down", "weight": 3.0, "on_error": "none"}, by_length])
    with caplog.at_level("WARNING", logger="grouprl.rewards.scoring"):
        result = rewards.score(PROMPTS, COMPLETIONS)
    assert result.components["_t_judge_down"] == [None, None, None]
    assert result.total == [1.0, 2.0, 3.0]  # the length alone: the failed reward adds nothing, not 3 * 0
    assert "reward '_t_judge_down' raised ConnectionError: judge unreachable (a batch of 3 row(s))" in (
        result.errors["_t_judge_down"])
    assert result.metrics()["rewards/_t_judge_down/failed"] == 1.0
    assert result.metrics()["rewards/by_length/failed"] == 0.0
    assert any("_t_judge_down" in r.getMessage() for r in caplog.records)
    # alone, it leaves every row unscored: an error naming why, or None totals; never 0
    alone = RewardSet.from_specs([{"name": "_t_judge_down", "on_error": "none"}])
    with pytest.raises(RewardError, match=r"row 0: every reward returned None.*judge unreachable"):
        alone.score(PROMPTS, COMPLETIONS)
    assert alone.score(PROMPTS, COMPLETIONS, allow_unscored=True).total == [None, None, None]
    # a contract break is a bug in the reward, never forgiven by on_error
    register_reward("_t_too_short")(lambda prompts, completions, **kwargs: [1.0])
    with pytest.raises(RewardError, match=r"reward '_t_too_short' returned 1 values for 3 completions"):
        RewardSet.from_specs([{"name": "_t_too_short", "on_error": "none"}]).score(PROMPTS, COMPLETIONS)


def test_a_failing_sync_reward_does_not_wait_for_the_async_ones():
    started = []

    async def slow_judge(prompts, completions, **kwargs):
        started.append(True)
        await asyncio.sleep(30)
        return [1.0] * len(completions)

    def broken(prompts, completions, **kwargs):
        raise KeyError("no such field")

    with pytest.raises(RewardError, match=r"reward 'broken' raised KeyError"):
        score([slow_judge, broken])
    assert started == []  # its coroutine was closed, never run


def test_empty_batch_scores_nothing():
    result = score([by_length], prompts=[], completions=[])
    assert result.total == [] and result.components == {"by_length": []}
    assert result.metrics() == {"rewards/by_length/applicable_frac": 0.0, "rewards/by_length/failed": 0.0}


# ---------------------------------------------------------------- metrics


def test_metrics_per_component_ignore_none():
    def half(prompts, completions, **kwargs):
        return [1.0, None, 0.0]

    def never(prompts, completions, **kwargs):
        return [None, None, None]

    metrics = score([half, by_length, never]).metrics()
    assert metrics["rewards/half/mean"] == 0.5
    assert metrics["rewards/half/std"] == 0.5
    assert metrics["rewards/half/applicable_frac"] == pytest.approx(2 / 3)
    assert metrics["rewards/by_length/mean"] == 2.0
    assert metrics["rewards/by_length/std"] == pytest.approx(math.sqrt(2 / 3))
    assert metrics["rewards/never/applicable_frac"] == 0.0
    assert "rewards/never/mean" not in metrics  # no NaN in the logs
    # totals: 2.0, 2.0, 3.0
    assert metrics["reward/mean"] == pytest.approx(7 / 3)
    assert metrics["reward/std"] == pytest.approx(math.sqrt(2 / 9))
    assert all(isinstance(v, float) for v in metrics.values())


# ---------------------------------------------------------------- registry and loading


def test_register_and_get_by_name(clean_registry):
    @register_reward("_t_constant")
    def constant(prompts, completions, **kwargs):
        return [0.5] * len(completions)

    assert get_reward("_t_constant") is constant
    assert "_t_constant" in registered_rewards()
    assert score(["_t_constant"]).total == [0.5, 0.5, 0.5]


def test_register_rejects_clashes_and_reserved_characters(clean_registry):
    register_reward("_t_taken")(by_length)

    def other(prompts, completions, **kwargs):
        return []

    with pytest.raises(ValueError, match=r"'_t_taken' is already registered"):
        register_reward("_t_taken")(other)
    for bad in ("a:b", "a@1", ""):
        with pytest.raises(ValueError):
            register_reward(bad)
    with pytest.raises(TypeError, match=r"reward '_t_number' must be a callable, got int"):
        register_reward("_t_number", 3)


def test_unknown_name_lists_known_names():
    expected = r"unknown reward 'acuracy'.*Known rewards: .*accuracy, .*format, .*length"
    with pytest.raises(RewardLoadError, match=expected) as err:
        get_reward("acuracy")
    assert "Did you mean accuracy" in str(err.value)


def test_load_function_from_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        textwrap.dedent(
            """
            CALLS = []

            def exact(prompts, completions, answer, **kwargs):
                CALLS.append(len(completions))
                return [float(c == a) for c, a in zip(completions, answer)]

            async def shout(prompts, completions, *, bonus=0.0, **kwargs):
                return [float(c.isupper()) + bonus for c in completions]

            NOT_A_FUNCTION = 3
            """
        )
    )
    exact = get_reward(f"{path}:exact")
    assert exact(["p"], ["x"], answer=["x"]) == [1.0]
    # The same file is executed once, so its functions share module state.
    assert get_reward(f"{path}:exact") is exact
    result = score(
        [f"{path}:exact", RewardSpec(f"{path}:shout", 0.5, {"bonus": 1.0})],
        {"answer": ["a", "x", "ccc"]},
        completions=["a", "BB", "ccc"],
    )
    assert result.components[f"{path}:shout"] == [1.0, 2.0, 1.0]
    assert result.total == [1.5, 1.0, 1.5]


def test_file_loading_errors_name_the_file_and_function(tmp_path):
    path = tmp_path / "rw.py"
    path.write_text("def good(prompts, completions, **kw):\n    return []\nVALUE = 3\n")
    with pytest.raises(RewardLoadError, match=r"reward file .*missing\.py not found .* for function 'f'"):
        get_reward(f"{tmp_path / 'missing.py'}:f")
    expected = r"reward file .*rw\.py has no function 'bad'; callables defined there: good"
    with pytest.raises(RewardLoadError, match=expected):
        get_reward(f"{path}:bad")
    with pytest.raises(RewardLoadError, match=r"reward file .*rw\.py: 'VALUE' is a int, not a callable"):
        get_reward(f"{path}:VALUE")
    with pytest.raises(RewardLoadError, match=r"names a file but no function"):
        get_reward(str(path))
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_anywhere\n")
    with pytest.raises(RewardLoadError, match=r"reward file .*broken\.py failed to import: ModuleNotFoundError"):
        get_reward(f"{broken}:f")


def test_load_function_from_module():
    assert get_reward("grouprl.rewards.rule_based:length_reward") is rule_based.length_reward
    with pytest.raises(RewardLoadError, match=r"reward module 'no_such_pkg.rewards' cannot be imported"):
        get_reward("no_such_pkg.rewards:f")


def test_rewards_layer_imports_no_torch():
    code = "import sys, grouprl.rewards; bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{ \sqrt{\frac{a}{b^{2}}} }", r"\sqrt{\frac{a}{b^{2}}}"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped set braces do not close the group
        (r"\boxed {7}", "7"),
        (r"\boxed{3} and a truncated \boxed{\frac{1", "3"),
        (r"\boxed{\frac{1", None),
        ("no box here", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"<answer>x</answer> but \boxed{y}", "y"),
        ("<think>t</think><answer> 12 </answer>", "12"),
        ("<answer>1</answer><answer>2</answer>", "2"),
        ("  plain 5  ", "plain 5"),
        ("<answer>never closed", "<answer>never closed"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("  The  Answer. ", "the answer"), ("$5$", "5"), ("$$x^2$$", "x^2"), ("$5$.", "5"), ("Yes\n\tNo", "yes no")],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


# ---------------------------------------------------------------- built-in rewards


def format_scores(completions, **kwargs):
    spec = RewardSpec("format", kwargs=kwargs) if kwargs else "format"
    return score([spec], prompts=["p"] * len(completions), completions=completions).components["format"]


def test_format_think_answer():
    good = [
        "<think>reasoning</think><answer>4</answer>",
        "\n <think>\nmulti\nline\n</think>\n\n<answer>\n4\n</answer>\n",
        "<think></think><answer>4</answer>",
    ]
    bad = [
        "<think>r</think><answer>4</answer> trailing text",
        "preamble <think>r</think><answer>4</answer>",
        "<answer>4</answer><think>r</think>",
        "<think>r</think>",
        "<think>r</think><answer>   </answer>",
        "<think>r</think><answer>1</answer> <answer>2</answer>",
        "<think>a</think><think>b</think><answer>1</answer>",
        "<think>r<answer>4</answer>",
        "4",
    ]
    assert format_scores(good) == [1.0] * len(good)
    assert format_scores(bad) == [0.0] * len(bad)


def test_format_boxed_and_think_boxed():
    completions = [
        r"The answer is \boxed{\frac{1}{2}}.",
        r"\boxed{}",
        r"unbalanced \boxed{\frac{1}{2}",
        r"<think>work</think> so \boxed{3}",
        r"<think>\boxed{3}</think> no box after",
        r"text <think>w</think> \boxed{3}",
    ]
    assert format_scores(completions, style="boxed") == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert format_scores(completions, style="think_boxed") == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_format_unknown_style_names_the_reward():
    with pytest.raises(RewardError, match=r"reward 'format' raised ValueError: unknown format style 'latex'"):
        format_scores(["x"], style="latex")


@pytest.fixture
def without_math_verify(monkeypatch):
    monkeypatch.setattr(rule_based, "_math_verify", lambda: None)


def accuracy_scores(completions, answers):
    # by_length rides along so that rows without a reference (None) are still scored by something.
    return score(
        ["accuracy", by_length], {"answer": answers}, prompts=["p"] * len(completions), completions=completions
    ).components["accuracy"]


def test_accuracy_text_match_and_not_applicable(without_math_verify):
    completions = [
        r"<think>...</think><answer>\boxed{\frac{1}{2}}</answer>",
        "<answer> Paris. </answer>",
        "$42$",
        "The answer is 41",
        "anything",
        "<answer>0.5</answer>",
        "<answer>b</answer>",
    ]
    answers = [r"\frac{1}{2}", "paris", r"\boxed{42}", "42", None, r"\frac{1}{2}", ["a", "B"]]
    assert accuracy_scores(completions, answers) == [1.0, 1.0, 1.0, 0.0, None, 0.0, 1.0]


def test_accuracy_numeric_reference_is_compared_as_text(without_math_verify):
    assert accuracy_scores(["7", "7.0"], [7, 7]) == [1.0, 0.0]


def test_accuracy_without_answer_column_is_a_clear_error():
    with pytest.raises(RewardError, match=r"reward 'accuracy' raised ValueError: needs an 'answer' column"):
        score(["accuracy"], {"solution": ["1", "2", "3"]})


def test_accuracy_uses_math_verify_equivalence():
    pytest.importorskip("math_verify")
    completions = [r"\boxed{0.5}", r"<answer>\frac12</answer>", r"\boxed{1+x}", r"\boxed{3}", "not math {"]
    answers = [r"\frac{1}{2}", "0.5", "x+1", "2", "1"]
    assert accuracy_scores(completions, answers) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_verify_works_off_the_main_thread():
    pytest.importorskip("math_verify")
    results = []
    thread = threading.Thread(target=lambda: results.append(rule_based.math_equal(r"\frac{1}{2}", "0.5")))
    thread.start()
    thread.join()
    assert results == [True]


def test_length_target_and_max_length():
    completions = ["one", "one two", "one two three four", " ".join(["w"] * 9)]
    target = score([RewardSpec("length", kwargs={"target": 2})], prompts=["p"] * 4, completions=completions)
    assert target.components["length"] == [-0.5, 0.0, -1.0, -1.0]
    limit = score([RewardSpec("length", kwargs={"max_length": 2})], prompts=["p"] * 4, completions=completions)
    assert limit.components["length"] == [0.0, 0.0, -1.0, -1.0]
    limit4 = score([RewardSpec("length", kwargs={"max_length": 4})], prompts=["p"] * 4, completions=completions)
    assert limit4.components["length"] == [0.0, 0.0, 0.0, -1.0]
    limit6 = score([RewardSpec("length", kwargs={"max_length": 6})], prompts=["p"] * 4, completions=completions)
    assert limit6.components["length"] == [0.0, 0.0, 0.0, -0.5]


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({}, "give exactly one of the options 'target' or 'max_length'"),
        ({"target": 3, "max_length": 5}, "give exactly one of the options"),
        ({"target": 0}, r"option 'target' must be a positive integer"),
        ({"max_length": 2.5}, r"option 'max_length' must be a positive integer"),
    ],
)
def test_length_option_errors(options, pattern):
    with pytest.raises(RewardError, match=rf"reward 'length' raised ValueError: {pattern}"):
        score([RewardSpec("length", kwargs=options)])
