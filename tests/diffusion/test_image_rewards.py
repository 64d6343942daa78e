"""Image rewards: the image contract's registry, specs, concurrent scoring and failures (grouprl.rewards,
the same code as the text rewards'), and the rewards of grouprl.domains.diffusion.rewards: OCR, the VLM judge.

The VLM judge runs against a real OpenAI-compatible server on loopback: a small FastAPI
app served by uvicorn in a thread, which checks the bearer key, decodes the image data
URL, records every request and can be told to fail or hold requests.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageFont

from grouprl.config import RewardFunctionConfig
from grouprl.domains.diffusion import rewards
from grouprl.domains.diffusion.rewards import (
    ImageRewardSet,
    ImageRewardSpec,
    JudgeError,
    get_image_reward,
    levenshtein,
    list_image_rewards,
    normalize_ocr_text,
    ocr_score,
    ocr_targets,
    quoted_text,
    register_image_reward,
    score_images,
)
from grouprl.rewards import RewardComponent, RewardError, RewardLoadError, RewardSet, RewardSpec

# The judge's server needs FastAPI at module level (it resolves the handler's annotations
# from the module); without it only the server tests are skipped.
try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
except ImportError:
    FastAPI = None


def solid(colour, size=(8, 8), mode="RGB") -> Image.Image:
    return Image.new(mode, size, colour)


# ---------------------------------------------------------------------------- registry


def test_builtins_are_registered_and_text_rewards_are_not():
    assert {"ocr", "vlm_judge", "image_brightness"} <= set(list_image_rewards())
    assert get_image_reward("image_brightness") is rewards.image_brightness_reward
    with pytest.raises(RewardLoadError, match=r"unknown image reward 'accuracy'.*Known image rewards: .*ocr"):
        get_image_reward("accuracy")


def test_the_plugin_registers_the_builtins_without_importing_them():
    code = textwrap.dedent("""
        import json, sys
        from grouprl.rewards import IMAGE_REWARDS, ImageRewardSet, get_reward, registered_rewards
        names = registered_rewards(IMAGE_REWARDS)
        imported_by_listing = "grouprl.domains.diffusion.rewards" in sys.modules
        fn = get_reward("image_brightness", IMAGE_REWARDS)
        keys = ImageRewardSet.from_specs(["shapes"]).keys
        print(json.dumps({"names": names, "before": imported_by_listing, "module": fn.__module__, "keys": keys}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"ocr", "vlm_judge", "image_brightness", "shapes"} <= set(seen["names"])
    assert seen["before"] is False and seen["module"] == "grouprl.domains.diffusion.rewards"
    assert seen["keys"] == ["shapes"]


def test_a_name_of_the_other_contract_says_so():
    with pytest.raises(RewardLoadError, match=r"'accuracy' is a text reward, f\(prompts, completions"):
        get_image_reward("accuracy")
    with pytest.raises(RewardLoadError, match=r"unknown reward 'ocr'.*'ocr' is an image reward, f\(images, prompts"):
        RewardSet.from_specs(["ocr"])


def test_register_a_name_and_refuse_clashes():
    @register_image_reward("test_only_redness")
    def redness(images, prompts, **metadata):
        return [image.getpixel((0, 0))[0] / 255 for image in images]

    assert get_image_reward("test_only_redness") is redness
    assert "test_only_redness" in list_image_rewards()
    with pytest.raises(ValueError, match="already registered"):
        register_image_reward("test_only_redness")(lambda images, prompts, **metadata: [])
    for bad in ("a:b", "a@1", " "):
        with pytest.raises(ValueError):
            register_image_reward(bad)


USER_FILE = '''
def redness(images, prompts, **metadata):
    """The red channel of the top-left pixel, in [0, 1]."""
    return [image.getpixel((0, 0))[0] / 255 for image in images]

def strict(images, prompts):
    return [0.0] * len(images)
'''


@pytest.fixture
def user_file(tmp_path) -> Path:
    path = tmp_path / "my_image_rewards.py"
    path.write_text(USER_FILE)
    return path


def test_a_function_from_a_file_and_from_a_module(user_file):
    fn = get_image_reward(f"{user_file}:redness")
    assert fn([solid((255, 0, 0)), solid((0, 0, 0))], ["a", "b"]) == [1.0, 0.0]
    result = score_images([f"{user_file}:redness"], [solid((51, 0, 0))], ["a"])
    # keyed by the reference as written, as on the text side
    assert result.components == {f"{user_file}:redness": [0.2]} and result.total == [0.2]
    assert get_image_reward("grouprl.domains.diffusion.rewards:image_brightness_reward") is rewards.image_brightness_reward


def test_load_errors_name_the_spec(user_file, tmp_path):
    missing = f"{tmp_path / 'nowhere.py'}:redness"
    with pytest.raises(RewardLoadError) as exc:
        get_image_reward(missing)
    assert missing in str(exc.value) and "not found" in str(exc.value)
    with pytest.raises(RewardLoadError) as exc:
        get_image_reward(f"{user_file}:blueness")
    assert f"{user_file}:blueness" in str(exc.value) and "'blueness'" in str(exc.value) and "redness" in str(exc.value)
    with pytest.raises(RewardLoadError, match="names a file but no function"):
        get_image_reward(str(user_file))
    with pytest.raises(RewardLoadError, match="no_such_module_xyz:f"):
        get_image_reward("no_such_module_xyz:f")
    # the contract: **metadata is required, options must be named parameters
    with pytest.raises(RewardLoadError, match=r"'.*:strict' must accept \*\*metadata"):
        ImageRewardSet.from_specs([f"{user_file}:strict"])
    with pytest.raises(RewardLoadError, match="image reward 'ocr' has no option 'substring'.*substring_match"):
        ImageRewardSet.from_specs([{"name": "ocr", "kwargs": {"substring": False}}])


# ---------------------------------------------------------------------------- specs


def test_specs_from_every_form():
    loaded = ImageRewardSet.from_specs([
        "image_brightness",
        RewardSpec("image_brightness", 2.0),
        RewardFunctionConfig(name="image_brightness", weight=0.5),
        {"name": "ocr", "weight": 0.25, "kwargs": {"substring_match": False}, "on_error": "none"},
        ImageRewardSpec("vlm_judge", kwargs={"base_url": "http://x/v1"}),
    ])
    assert loaded.keys == ["image_brightness@0", "image_brightness@1", "image_brightness@2", "ocr", "vlm_judge"]
    assert list(loaded.weights.values()) == [1.0, 2.0, 0.5, 0.25, 1.0]
    assert [c.on_error for c in loaded.components] == ["raise"] * 3 + ["none", "raise"]
    assert loaded.components[3].options == {"substring_match": False}
    with pytest.raises(RewardLoadError, match=r"unknown keys \['wieght'\]"):
        ImageRewardSpec.coerce({"name": "ocr", "wieght": 2})
    with pytest.raises(RewardLoadError, match="image reward 'ocr': on_error must be one of raise, none"):
        ImageRewardSpec("ocr", on_error="zero")
    with pytest.raises(RewardLoadError, match="weight must be finite"):
        ImageRewardSpec("ocr", weight=float("nan"))


# ---------------------------------------------------------------------------- scoring


def test_weighted_total_skips_rows_a_reward_does_not_apply_to():
    def first(images, prompts, **metadata):
        return [1.0, None, None]

    def second(images, prompts, **metadata):
        return [0.2, 0.4, None]

    loaded = ImageRewardSet([RewardComponent("first", first, 0.5), RewardComponent("second", second, 2.0)])
    images, prompts = [solid("white")] * 3, ["a", "b", "c"]
    result = loaded.score(images, prompts, allow_unscored=True)
    assert result.components == {"first": [1.0, None, None], "second": [0.2, 0.4, None]}
    assert result.total[0] == pytest.approx(0.5 * 1.0 + 2.0 * 0.2)
    assert result.total[1] == pytest.approx(0.8)
    assert result.total[2] is None  # unscored, not 0
    assert result.weights == {"first": 0.5, "second": 2.0}
    metrics = result.metrics()
    assert metrics["rewards/first/applicable_frac"] == pytest.approx(1 / 3)
    assert metrics["rewards/first/failed"] == 0.0
    with pytest.raises(RewardError, match=r"row 2: every image reward returned None \(first, second\)"):
        loaded.score(images, prompts)


def test_async_and_sync_rewards_overlap():
    sync_in, async_in = threading.Event(), threading.Event()
    threads = {}

    def sync_reward(images, prompts, **metadata):
        threads["sync"] = threading.get_ident()
        sync_in.set()
        # Only True when the async reward runs while this one is still running.
        return [1.0 if async_in.wait(timeout=5) else 0.0] * len(images)

    async def async_reward(images, prompts, **metadata):
        threads["loop"] = threading.get_ident()
        async_in.set()
        overlapped = await asyncio.to_thread(sync_in.wait, 5)
        return [1.0 if overlapped else 0.0] * len(images)

    result = score_images([sync_reward, async_reward], [solid("white")] * 2, ["a", "b"])
    assert result.components == {"sync_reward": [1.0, 1.0], "async_reward": [1.0, 1.0]}
    assert threads["sync"] != threads["loop"]  # the sync reward ran off the event loop


def test_two_sync_rewards_run_in_parallel_threads():
    barrier = threading.Barrier(2, timeout=5)  # broken (an error) unless both are inside at once

    def left(images, prompts, **metadata):
        barrier.wait()
        return [0.25] * len(images)

    def right(images, prompts, **metadata):
        barrier.wait()
        return [0.5] * len(images)

    result = score_images([left, right], [solid("white")], ["a"])
    assert result.total == [0.75]


def test_scoring_from_inside_a_running_event_loop():
    async def half(images, prompts, **metadata):
        await asyncio.sleep(0)
        return [0.5] * len(images)

    async def caller():
        blocking = score_images([half, "image_brightness"], [solid("white")], ["a"])
        awaited = await rewards.ascore_images([half, "image_brightness"], [solid("black")], ["a"])
        return blocking, awaited

    blocking, awaited = asyncio.run(caller())
    assert blocking.total == [1.5] and awaited.total == [0.5]


def test_a_raising_reward_fails_the_batch_naming_it_and_the_row_count():
    def boom(images, prompts, **metadata):
        raise ZeroDivisionError("no light")

    with pytest.raises(RewardError) as exc:
        score_images(["image_brightness", boom], [solid("white")] * 3, ["a", "b", "c"])
    assert exc.value.reward == "boom"
    assert "image reward 'boom' raised ZeroDivisionError: no light (a batch of 3 row(s))" in str(exc.value)


def test_on_error_none_leaves_rows_unscored_and_records_why(caplog, user_file):
    async def judge_down(images, prompts, **metadata):
        raise ConnectionError("judge unreachable")

    register_image_reward("test_only_judge_down")(judge_down)
    specs = [{"name": "test_only_judge_down", "weight": 3.0, "on_error": "none"}, "image_brightness"]
    with caplog.at_level(logging.WARNING, logger="grouprl.rewards.scoring"):
        result = score_images(specs, [solid("white"), solid("black")], ["a", "b"])
    assert result.components["test_only_judge_down"] == [None, None]
    assert result.total == [1.0, 0.0]  # the brightness alone; the failed reward adds nothing, not 3 * 0
    assert "judge unreachable" in result.errors["test_only_judge_down"]
    assert result.metrics()["rewards/test_only_judge_down/failed"] == 1.0
    assert any("test_only_judge_down" in r.getMessage() for r in caplog.records)
    # alone, it leaves every row unscored: an error, or None totals, never 0
    alone = [{"name": "test_only_judge_down", "on_error": "none"}]
    with pytest.raises(RewardError, match="every image reward returned None.*judge unreachable"):
        score_images(alone, [solid("white")], ["a"])
    assert score_images(alone, [solid("white")], ["a"], allow_unscored=True).total == [None]


@pytest.mark.parametrize("returned, message", [
    ([1.0], r"image reward 'bad' returned 1 values for 2 images"),
    ([1.0, 2.0, 3.0], r"image reward 'bad' returned 3 values for 2 images"),
    ([1.0, float("nan")], r"image reward 'bad' returned nan at row 1"),
    ([1.0, "0.5"], r"image reward 'bad' returned a str \('0.5'\) at row 1"),
    (0.5, r"image reward 'bad' returned a float"),
])
def test_contract_breaks_always_raise(returned, message):
    def bad(images, prompts, **metadata):
        return returned

    register_image_reward("test_only_bad")(bad)
    for spec in (bad, {"name": "test_only_bad", "on_error": "none"}):  # a bug in the reward is never forgiven
        with pytest.raises(RewardError, match=message.replace("'bad'", "'(test_only_)?bad'")):
            score_images([spec], [solid("white")] * 2, ["a", "b"])


def test_metadata_columns_and_input_checks():
    seen = {}

    def reads_columns(images, prompts, *, colour=None, **metadata):
        seen.update(colour=colour, modes=[image.mode for image in images], rest=sorted(metadata))
        return [1.0] * len(images)

    images = [solid("white"), solid((0, 0, 0, 0), mode="RGBA")]
    score_images([reads_columns], images, ["a", "b"], {"colour": ["red", "blue"], "text": ["x", None]})
    assert seen == {"colour": ["red", "blue"], "modes": ["RGB", "RGB"], "rest": ["text"]}
    with pytest.raises(ValueError, match="metadata column 'text' has 1 values for 2 images"):
        score_images([reads_columns], images, ["a", "b"], {"text": ["x"]})
    with pytest.raises(ValueError, match="metadata column 'images' clashes"):
        score_images([reads_columns], images, ["a", "b"], {"images": [1, 2]})
    with pytest.raises(ValueError, match="got 1 prompts for 2 images"):
        score_images([reads_columns], images, ["a"])
    with pytest.raises(TypeError, match=r"images\[1\] must be a PIL.Image, got str"):
        score_images([reads_columns], [solid("white"), "x.png"], ["a", "b"])
    register_image_reward("test_only_reads_columns")(reads_columns)
    with pytest.raises(RewardError, match=r"option\(s\) \['colour'\] have the same name as metadata column"):
        score_images([{"name": "test_only_reads_columns", "kwargs": {"colour": "red"}}], images, ["a", "b"],
                     {"colour": ["red", "blue"]})
    assert score_images([reads_columns], [], []).total == []


def test_image_brightness():
    values = rewards.image_brightness_reward([solid("white"), solid("black"), solid((255, 0, 0))], ["a"] * 3)
    assert values == pytest.approx([1.0, 0.0, 1 / 3])


# ---------------------------------------------------------------------------- OCR: the formula


@pytest.mark.parametrize("a, b, d", [
    ("", "", 0), ("abc", "", 3), ("", "ab", 2), ("kitten", "sitting", 3), ("flaw", "lawn", 2),
    ("hello42", "hel1o42", 1), ("abc", "abc", 0), ("ab", "ba", 2),
])
def test_levenshtein(a, b, d):
    assert levenshtein(a, b) == d and levenshtein(b, a) == d


def test_targets_and_normalisation():
    assert normalize_ocr_text(" Hello  World\n42\t") == "helloworld42"
    assert quoted_text('a neon sign that says "Open 24h" above a "door"') == "Open 24h"
    assert quoted_text('an unclosed "quote') is None and quoted_text("no quotes") is None
    prompts = ['a sign "STOP"', 'a sign "GO"', "no quotes", 'blank "  "']
    assert ocr_targets(prompts) == ["STOP", "GO", None, None]
    assert ocr_targets(prompts, ["Yield", None, "exit", None]) == ["Yield", "GO", "exit", None]


def test_ocr_score():
    assert ocr_score("HELLO 42", "hello42") == 1.0
    assert ocr_score("HELLO 4", "hello 42") == pytest.approx(1 - 1 / 7)
    assert ocr_score("xxxxxxxxxxxxxxxxxxxx", "ab") == 0.0  # distance capped at the target's length
    assert ocr_score("", "ab") == 0.0
    # Flow-GRPO's rule: the target inside more text is a match; without it the extra text costs
    assert ocr_score("BIG SALE today", "sale") == 1.0
    assert ocr_score("BIG SALE today", "sale", substring_match=False) == 0.0
    assert ocr_score("SALE!", "sale", substring_match=False) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="empty after normalisation"):
        ocr_score("abc", " \n")


# ---------------------------------------------------------------------------- OCR: RapidOCR on rendered text


def render(text: str, size=(440, 120)) -> Image.Image:
    fonts = sorted(Path("/usr/share/fonts").rglob("DejaVuSans.ttf")) if Path("/usr/share/fonts").exists() else []
    font = ImageFont.truetype(str(fonts[0]), 64) if fonts else ImageFont.load_default(size=64)
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((20, 20), text, fill="black", font=font)
    return image


def test_ocr_reward_on_rendered_text():
    pytest.importorskip("rapidocr_onnxruntime", reason="rapidocr_onnxruntime is not installed (grouprl[ocr])")
    image = render("HELLO 42")
    prompts = ['a poster with "HELLO 42" on it', 'a poster with "GOODBYE 7" on it', "a poster", 'a "HELLO 42"']
    result = score_images(["ocr"], [image, image, image, solid("white", (64, 64))], prompts,
                          {"text": [None, None, None, None]}, allow_unscored=True)
    right, wrong, no_target, blank = result.components["ocr"]
    assert right > 0.8
    assert wrong < 0.5 and wrong < right
    assert no_target is None and result.total[2] is None
    assert blank == 0.0  # nothing read: the full distance
    engine = rewards._OCR_ENGINE
    # the text column overrides the prompt's quotes; the engine is built once
    (overridden,) = rewards.ocr_reward([image], ['a poster with "GOODBYE 7"'], text=["hello 42"])
    assert overridden > 0.8 and rewards._OCR_ENGINE is engine is not None


def test_ocr_without_rapidocr_names_the_extra(monkeypatch):
    monkeypatch.setattr(rewards, "_OCR_ENGINE", None)
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # import now raises ImportError
    with pytest.raises(RewardError, match=r"image reward 'ocr' raised ImportError.*pip install 'grouprl\[ocr\]'"):
        score_images(["ocr"], [solid("white")], ['a sign "STOP"'])


# ---------------------------------------------------------------------------- VLM judge: a real server


class FakeJudge:
    """What the server does; the test sets it, the server reads it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seen: list[dict] = []  # per request: headers, body, the decoded image's format and size, the text
        self.fail: list[int] = []  # statuses to answer with first, one per request
        self.status: int | None = None  # answer every request with this status
        self.retry_after: dict[str, str] = {"retry-after-ms": "1"}  # sent with failures: retries follow at once
        self.required_key: str | None = None
        self.reply: Callable[[dict], str] = lambda seen: "The image matches well.\nFinal Score: 4"
        self.delay = 0.0
        self.hold_until_in_flight = 0  # hold each request until this many were in flight at once (5 s at most)
        self.in_flight = 0
        self.max_in_flight = 0


def create_app(judge: FakeJudge):
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        record = {"headers": dict(request.headers), "body": body}
        judge.seen.append(record)
        judge.in_flight += 1
        judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
        try:
            deadline = time.monotonic() + 5
            while judge.max_in_flight < judge.hold_until_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            await asyncio.sleep(judge.delay)
        finally:
            judge.in_flight -= 1
        if judge.required_key and request.headers.get("authorization") != f"Bearer {judge.required_key}":
            return JSONResponse({"error": {"message": "invalid api key"}}, status_code=401)
        try:
            (message,) = body["messages"]
            *image_parts, text_part = message["content"]  # pairwise judging sends two images
            decoded = []
            for image_part in image_parts:
                url = image_part["image_url"]["url"]
                prefix = "data:image/png;base64,"
                assert message["role"] == "user" and image_part["type"] == "image_url" and url.startswith(prefix)
                image = Image.open(io.BytesIO(base64.b64decode(url[len(prefix):], validate=True)))
                image.load()
                decoded.append(image)
            assert decoded and text_part["type"] == "text"
            record.update(format=decoded[0].format, size=decoded[0].size, text=text_part["text"],
                          colours=[image.convert("RGB").getpixel((0, 0)) for image in decoded])
        except Exception as exc:  # a malformed request: the test sees a 400
            return JSONResponse({"error": {"message": f"bad request: {exc!r}"}}, status_code=400)
        status = judge.fail.pop(0) if judge.fail else judge.status
        if status is not None:
            return JSONResponse({"error": {"message": f"told to answer {status}"}}, status_code=status,
                                headers=judge.retry_after)
        content = judge.reply(record)
        return {"id": "x", "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}

    return app


@pytest.fixture(scope="module")
def server(serve_app):
    if FastAPI is None:
        pytest.skip("fastapi is not installed (grouprl[server])")
    pytest.importorskip("httpx")
    judge = FakeJudge()
    with serve_app(create_app(judge), timeout_graceful_shutdown=1) as port:
        yield judge, f"http://127.0.0.1:{port}/v1"


@pytest.fixture
def judge(server, monkeypatch):
    monkeypatch.delenv("GROUPRL_JUDGE_API_KEY", raising=False)
    server[0].reset()
    return server[0]


@pytest.fixture
def call(server):
    """Score with the vlm_judge through the real entry point (a spec), options defaulted for tests."""

    def call(images, prompts, metadata=None, **options):
        kwargs = {"base_url": server[1], "model": "judge-vl", "timeout": 5.0, **options}
        result = score_images([{"name": "vlm_judge", "kwargs": kwargs}], images, prompts, metadata,
                              allow_unscored=True)
        return result.components["vlm_judge"]

    return call


def test_judge_request_and_final_score(judge, call):
    judge.required_key = "sk-judge"
    images = [solid("red", (40, 24)), solid("blue", (24, 40))]
    scores = call(images, ["a red square", "a blue square"], api_key="sk-judge", max_tokens=77)
    assert scores == [pytest.approx(0.8), pytest.approx(0.8)]
    assert len(judge.seen) == 2
    by_text = {seen["text"].split("Caption: ")[1].split("\n")[0]: seen for seen in judge.seen}
    for caption, image in zip(["a red square", "a blue square"], images):
        seen = by_text[caption]
        assert seen["headers"]["authorization"] == "Bearer sk-judge"
        assert seen["format"] == "PNG" and seen["size"] == image.size
        assert seen["body"]["model"] == "judge-vl" and seen["body"]["max_tokens"] == 77
        assert "Final Score: x" in seen["text"]


def test_judge_key_from_the_environment_and_the_last_score_wins(judge, call, monkeypatch):
    monkeypatch.setenv("GROUPRL_JUDGE_API_KEY", "sk-env")
    judge.required_key = "sk-env"
    judge.reply = lambda seen: "You asked for 'Final Score: x'. Final Score: 2?\nNo, better.\n**Final Score:** 4.5"
    assert call([solid("red")], ["a red square"]) == [pytest.approx(0.9)]


def test_a_wrong_key_is_refused_without_retries(judge, call):
    judge.required_key = "right"
    with pytest.raises(RewardError, match="refused row 0: HTTP 401") as exc:
        call([solid("red")], ["a"], api_key="wrong", max_retries=3)
    assert len(judge.seen) == 1 and exc.value.row == 0


@pytest.mark.parametrize("status", [500, 503, 429])
def test_judge_retries_then_succeeds(judge, call, status):
    judge.fail = [status, status]
    assert call([solid("red")], ["a"], max_retries=2) == [pytest.approx(0.8)]
    assert len(judge.seen) == 3


def test_judge_failing_after_retries_raises_naming_url_and_row(judge, server):
    judge.status = 500
    images, prompts = [solid("red")], ["a"]
    with pytest.raises(JudgeError) as exc:
        asyncio.run(rewards.vlm_judge_reward(images, prompts, base_url=server[1], max_retries=2))
    err = exc.value
    assert err.url == server[1] + "/chat/completions" and err.row == 0 and err.attempts == 3 and err.status == 500
    assert f"{server[1]}/chat/completions failed for row 0 after 3 attempt(s) (last status 500)" in str(err)
    assert len(judge.seen) == 3


def test_a_400_is_not_retried(judge, call):
    judge.status = 400
    with pytest.raises(RewardError, match="HTTP 400"):
        call([solid("red")], ["a"], max_retries=3)
    assert len(judge.seen) == 1


def test_judge_timeout_and_dead_server(judge, call):
    judge.delay = 2.0
    with pytest.raises(RewardError, match=r"row 0 after 1 attempt\(s\).*timed out after 0.2 s"):
        call([solid("red")], ["a"], timeout=0.2, max_retries=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(RewardError, match=r"after 2 attempt\(s\).*ConnectError"):
        call([solid("red")], ["a"], base_url=dead, max_retries=1)


def test_a_reply_without_a_score_raises_naming_the_row(judge, call):
    judge.reply = lambda seen: "A lovely cat." if "cat" in seen["text"] else "Final Score: 5"
    with pytest.raises(RewardError) as exc:
        call([solid("red")] * 3, ["a dog", "a cat", "a bird"])
    assert exc.value.row == 1
    assert "gave no 'Final Score: x' line for row 1" in str(exc.value) and "A lovely cat." in str(exc.value)
    judge.reply = lambda seen: "Final Score: 7"
    with pytest.raises(RewardError, match="Final Score 7 for row 0, off the 1-5 scale"):
        call([solid("red")], ["a dog"])


def test_judge_concurrency_is_bounded(judge, call):
    judge.hold_until_in_flight = 2  # each request waits for a second one: proves overlap without timing
    scores = call([solid("red")] * 6, [f"image {i}" for i in range(6)], concurrency=2)
    assert scores == [pytest.approx(0.8)] * 6
    assert judge.max_in_flight == 2 and len(judge.seen) == 6


def test_judge_ocr_mode(judge, call):
    judge.reply = lambda seen: "HELLO\n42"
    prompts = ['a poster "hello 42"', 'a poster "help 4"', "a poster without text", "a poster"]
    scores = call([solid("white", (32, 16))] * 4, prompts, {"text": [None, None, None, "Hello"]}, mode="ocr")
    assert scores == [1.0, pytest.approx(ocr_score("HELLO42", "help 4")), None, 1.0]
    assert scores[1] < 1.0
    assert len(judge.seen) == 3  # the row without a target is not sent
    assert all(seen["text"] == rewards.OCR_PROMPT and seen["size"] == (32, 16) for seen in judge.seen)


def test_retry_after_is_honoured(judge, call):
    judge.fail, judge.retry_after = [429], {"retry-after": "0.6"}  # longer than the client's own first wait, 0.5 s
    started = time.monotonic()
    assert call([solid("red")], ["a"], max_retries=1) == [pytest.approx(0.8)]
    assert time.monotonic() - started >= 0.6 and len(judge.seen) == 2


def test_judge_option_errors(judge, call):
    with pytest.raises(RewardError, match="mode must be one of unified_reward, ocr"):
        call([solid("red")], ["a"], mode="pickscore")
    with pytest.raises(RewardError, match="needs the option 'base_url'"):
        score_images(["vlm_judge"], [solid("red")], ["a"])
    with pytest.raises(RewardError, match="'retry_backoff' is no longer supported.*Retry-After.*'max_retries'"):
        call([solid("red")], ["a"], retry_backoff=1.0)
    assert judge.seen == []


# ---------------------------------------------------------------------------- VLM judge: UnifiedReward's templates


@pytest.mark.parametrize("mode, template", [("unified_reward_pointwise", "UNIFIED_REWARD_POINTWISE_PROMPT"),
                                            ("unified_reward_flow_grpo", "UNIFIED_REWARD_FLOW_GRPO_PROMPT")])
def test_judge_unified_reward_pointwise_templates(judge, call, mode, template):
    judge.reply = lambda seen: "cat (object): 1\nred (attribute): 0\nFinal Score: 3"
    assert call([solid("red"), solid("blue")], ["a red cat", "a blue dog"], mode=mode) == [pytest.approx(0.6)] * 2
    texts = sorted(seen["text"] for seen in judge.seen)
    assert texts == sorted(getattr(rewards, template).format(prompt=p) for p in ["a red cat", "a blue dog"])
    assert all(t.endswith(("Text Caption: [a red cat]", "Text Caption: [a blue dog]")) for t in texts)
    assert all(len(seen["colours"]) == 1 for seen in judge.seen)


RANK = {(255, 0, 0): 3, (0, 128, 0): 2, (0, 0, 255): 1}  # the fake judge prefers red, then green, then blue


def ranking_judge(seen):
    first, second = (RANK[c] for c in seen["colours"])
    if first == second:
        return "Both look alike. Both images are equally good."
    return "Image 1 is better." if first > second else "After comparing: image 2 is better."


def test_judge_pairwise_scores_each_image_by_its_wins_in_its_group(judge, call):
    judge.reply = ranking_judge
    images = [solid("red"), solid("green"), solid("blue"), solid("blue"), solid("blue")]
    prompts = ["a flag"] * 3 + ["a sea"] * 2
    scores = call(images, prompts, mode="unified_reward_pairwise", group_size=None)
    assert scores == [1.0, 0.5, 0.0, 0.5, 0.5]
    # every pair of a group, in both orders: 3 * 2 + 1 * 2 requests, each with two images and the group's prompt
    assert len(judge.seen) == 8 and all(len(seen["colours"]) == 2 for seen in judge.seen)
    flag_orders = sorted(tuple(RANK[c] for c in seen["colours"]) for seen in judge.seen if "[a flag]" in seen["text"])
    assert flag_orders == sorted([(3, 2), (2, 3), (3, 1), (1, 3), (2, 1), (1, 2)])
    assert all(seen["text"] == rewards.UNIFIED_REWARD_PAIRWISE_PROMPT.format(prompt="a flag")
               for seen in judge.seen if "[a flag]" in seen["text"])
    # group_size groups by blocks; the same batch gives the same scores
    judge.reset()
    judge.reply = ranking_judge
    assert call(images[:4], ["a flag"] * 4, mode="unified_reward_pairwise", group_size=2) == [1.0, 0.0, 0.5, 0.5]
    assert len(judge.seen) == 4


def test_judge_pairwise_both_orders_cancel_a_position_bias(judge, call):
    judge.reply = lambda seen: "Image 1 is better."  # always prefers the first image shown
    images, prompts = [solid("red"), solid("green"), solid("blue")], ["a flag"] * 3
    assert call(images, prompts, mode="unified_reward_pairwise") == [0.5, 0.5, 0.5]
    judge.reset()
    judge.reply = lambda seen: "Image 1 is better."
    # one order per pair (i before j): the bias decides
    assert call(images, prompts, mode="unified_reward_pairwise", both_orders=False) == [1.0, 0.5, 0.0]
    assert len(judge.seen) == 3


def test_pairwise_verdicts_and_groups():
    assert rewards.parse_pairwise_verdict("Image 1 is better.") == 1.0
    assert rewards.parse_pairwise_verdict('Say "Image 1 is better." ... so BOTH IMAGES ARE EQUALLY GOOD') == 0.5
    assert rewards.parse_pairwise_verdict("image 2 is better") == 0.0
    assert rewards.parse_pairwise_verdict("The first one.") is None
    assert rewards.prompt_groups(["a", "a", "b", "b", "b"]) == [[0, 1], [2, 3, 4]]
    assert rewards.prompt_groups(["a"] * 4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="got 3 rows, not whole groups of group_size=2"):
        rewards.prompt_groups(["a"] * 3, 2)
    with pytest.raises(ValueError, match="rows 0-1 of a group hold different prompts"):
        rewards.prompt_groups(["a", "b"], 2)
    with pytest.raises(ValueError, match="row 2 is the only image of its prompt"):
        rewards.prompt_groups(["a", "a", "b"])
    assert rewards.pairwise_win_rates(3, {(0, 1): 1.0, (1, 0): 0.5, (2, 1): 0.0}) == [0.75, 0.5, 0.0]


def test_judge_pairwise_errors(judge, call):
    judge.reply = lambda seen: "They are both nice."
    with pytest.raises(RewardError, match=r"gave no verdict .* comparing rows 0 and 1; reply: 'They are both nice.'"):
        call([solid("red"), solid("blue")], ["a", "a"], mode="unified_reward_pairwise", both_orders=False)
    judge.reset()
    with pytest.raises(RewardError, match="group_size is an option of mode 'unified_reward_pairwise'"):
        call([solid("red")], ["a"], group_size=2)
    with pytest.raises(RewardError, match="row 0 is the only image of its prompt"):
        call([solid("red")], ["a"], mode="unified_reward_pairwise")
    assert judge.seen == []
