"""The image rewards of the flow (diffusion) trainer: OCR accuracy, a VLM judge, brightness, the shapes task.

An image reward is ``fn(images, prompts, **metadata) -> list[float | None]``, the core's
image contract (:data:`grouprl.rewards.IMAGE`): RGB ``PIL`` images, shared by the rewards
of a set and not to be modified in place; ``metadata`` the prompt record's other fields
as per-row lists (e.g. ``text``, the OCR target); ``None`` = not applicable; plain
functions run in worker threads and ``async def`` ones on the event loop, every reward
of a set at once. Scoring, weights, ``on_error`` and the checks are the core's, the same
as for text rewards (:mod:`grouprl.rewards.scoring`)::

    rewards = ImageRewardSet.from_specs([{"name": "ocr"}, {"name": "vlm_judge", "weight": 0.5,
                                                            "kwargs": {"base_url": "http://judge:8000/v1"}}])
    result = rewards.score(images, prompts, {"text": targets})
    result.components["ocr"], result.total, result.errors, result.metrics()

or in one call, ``score_images(specs, images, prompts, metadata)``.

The rewards here are registered by name in the core's image reward registry
(:data:`grouprl.rewards.IMAGE_REWARDS`) by the diffusion plugin
(:mod:`grouprl.domains.diffusion.plugin`): ``ocr``, ``vlm_judge``, ``image_brightness``,
``shapes``. Any other function is referenced as ``path/to/file.py:function`` or
``module:function``, or registered with :func:`register_image_reward`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import threading
from typing import Any, Iterable, Mapping, Sequence

from grouprl.rewards import IMAGE_REWARDS, ImageRewardSet, RewardError, RewardResult
# Public here too, as before the image contract moved to the core.
from grouprl.rewards import ImageRewardSpec, register_image_reward  # noqa: F401
from grouprl.rewards.chat_endpoint import ChatCallError, ChatEndpoint, UnusableReply, excerpt
from grouprl.rewards.registry import get_reward, registered_rewards

# ---------------------------------------------------------------------------- the core's image rewards, by their names here


def get_image_reward(reference: str) -> Any:
    """The image reward for a registered name, ``path/to/file.py:function`` or ``module:function``
    (:func:`grouprl.rewards.get_reward` on the image registry)."""
    return get_reward(reference, IMAGE_REWARDS)


def list_image_rewards() -> list[str]:
    """The registered image reward names, those of every installed plugin included, sorted."""
    return registered_rewards(IMAGE_REWARDS)


def score_images(
    specs: ImageRewardSet | Iterable[Any], images: Sequence[Any], prompts: Sequence[str],
    metadata: Mapping[str, Sequence[Any]] | None = None, *, allow_unscored: bool = False,
) -> RewardResult:
    """Score a batch with ``specs`` (an :class:`ImageRewardSet`, or specs to load): per-reward values and the total.

    ``result.components[key][i]`` is reward ``key`` on row ``i`` (None: not applicable);
    ``result.total[i] = sum(weight[k] * components[k][i])`` over the rewards applying to row ``i``.
    """
    rewards = specs if isinstance(specs, ImageRewardSet) else ImageRewardSet.from_specs(specs)
    return rewards.score(images, prompts, metadata, allow_unscored=allow_unscored)


async def ascore_images(
    specs: ImageRewardSet | Iterable[Any], images: Sequence[Any], prompts: Sequence[str],
    metadata: Mapping[str, Sequence[Any]] | None = None, *, allow_unscored: bool = False,
) -> RewardResult:
    """:func:`score_images` on the caller's event loop."""
    rewards = specs if isinstance(specs, ImageRewardSet) else ImageRewardSet.from_specs(specs)
    return await rewards.ascore(images, prompts, metadata, allow_unscored=allow_unscored)


# ---------------------------------------------------------------------------- text targets and edit distance

_QUOTED = re.compile(r'"([^"]*)"')
_SPACES = re.compile(r"\s+")


def quoted_text(prompt: str) -> str | None:
    """The text between the first pair of ASCII double quotes of ``prompt`` (``'a sign saying "OPEN"'`` -> ``OPEN``),
    or None when it has no closed pair. Flow-GRPO's OCR prompts put the text to render there."""
    m = _QUOTED.search(prompt)
    return m.group(1) if m else None


def normalize_ocr_text(text: str) -> str:
    """Lowercase and remove every whitespace character.

    Flow-GRPO's OCR reward (``flow_grpo/ocr.py``) does ``text.replace(' ', '').lower()``
    on both sides: case and word spacing are not what the reward trains. Every
    whitespace character (newlines, tabs) goes here, not only the space, since a
    multi-line target or a VLM's reply may hold line breaks.
    """
    return _SPACES.sub("", text).lower()


def levenshtein(a: str, b: str) -> int:
    """The edit distance between ``a`` and ``b``: the fewest single-character insertions,
    deletions and substitutions that turn one into the other.

    Wagner-Fischer dynamic programming keeping one row: d[i][j] = min(d[i-1][j] + 1,
    d[i][j-1] + 1, d[i-1][j-1] + (a[i] != b[j])); O(len(a) len(b)) time, O(min) memory.
    """
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str, *, substring_match: bool = True) -> float:
    """1 - min(d, len(t)) / len(t), with r, t the normalised recognised and target texts
    (:func:`normalize_ocr_text`) and d = levenshtein(r, t); in [0, 1].

    ``substring_match`` (Flow-GRPO's rule): d = 0 when t occurs in r, so extra text
    around the target (a caption, a logo) is not penalised. Raises ValueError when the
    target is empty after normalisation (the ratio is undefined).
    """
    r, t = normalize_ocr_text(recognised), normalize_ocr_text(target)
    if not t:
        raise ValueError(f"OCR target {target!r} is empty after normalisation")
    distance = 0 if substring_match and t in r else levenshtein(r, t)
    return 1.0 - min(distance, len(t)) / len(t)


def ocr_targets(prompts: Sequence[str], text: Sequence[Any] | None = None) -> list[str | None]:
    """Each row's target: the ``text`` metadata value when given (and not None), else the prompt's quoted text.

    None (the row is not applicable) when neither gives a target that is non-empty after normalisation.
    """
    if text is not None and len(text) != len(prompts):
        raise ValueError(f"metadata column 'text' has {len(text)} values for {len(prompts)} prompts")
    targets: list[str | None] = []
    for row, prompt in enumerate(prompts):
        target = text[row] if text is not None and text[row] is not None else quoted_text(prompt)
        target = None if target is None else str(target)
        targets.append(target if target is not None and normalize_ocr_text(target) else None)
    return targets


# ---------------------------------------------------------------------------- built-in: ocr

# One engine for the process: building it loads three ONNX models (about a second). The
# lock guards building and every call, as RapidOCR's pipeline is not documented thread-safe
# and sync rewards run in worker threads.
_OCR_ENGINE: Any = None
_OCR_LOCK = threading.Lock()


def _ocr_engine() -> Any:
    """The shared RapidOCR engine; call with ``_OCR_LOCK`` held."""
    global _OCR_ENGINE
    if _OCR_ENGINE is None:
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as exc:
            raise ImportError(
                "the 'ocr' image reward needs rapidocr_onnxruntime: pip install 'grouprl[ocr]' "
                "(or pip install rapidocr_onnxruntime)"
            ) from exc
        _OCR_ENGINE = RapidOCR()
    return _OCR_ENGINE


def read_text(image: Any) -> str:
    """The text RapidOCR finds in ``image``: its detected strings concatenated in its reading
    order (top to bottom, left to right); ``""`` when it finds none.

    RapidOCR keeps the strings it recognises with confidence >= 0.5 (its ``text_score``);
    Flow-GRPO's PaddleOCR reading keeps every string with confidence > 0.
    """
    with _OCR_LOCK:
        result, _ = _ocr_engine()(image)  # a PIL image: RapidOCR converts RGB to its BGR itself
    return "".join(entry[1] for entry in result or [])


def ocr_reward(
    images: Sequence[Any], prompts: Sequence[str], *, text: Sequence[str | None] | None = None,
    substring_match: bool = True, **metadata: Any,
) -> list[float | None]:
    """OCR accuracy (Flow-GRPO): :func:`ocr_score` of RapidOCR's reading (:func:`read_text`) against the target.

    The target is the ``text`` metadata column when given, else the text between the
    prompt's first pair of double quotes (:func:`ocr_targets`); a row without one gets
    None and is not read. An OCR failure raises (Flow-GRPO scores it 0: here it is never
    a score). Needs ``rapidocr_onnxruntime`` (``pip install 'grouprl[ocr]'``).
    """
    targets = ocr_targets(prompts, text)
    return [
        None if target is None else ocr_score(read_text(image), target, substring_match=substring_match)
        for image, target in zip(images, targets)
    ]


# ---------------------------------------------------------------------------- built-in: image_brightness


def image_brightness_reward(images: Sequence[Any], prompts: Sequence[str], **metadata: Any) -> list[float]:
    """The mean pixel value in [0, 1] (over R, G, B and every pixel; 0 black, 1 white).

    A trivial sanity reward: its optimum is obvious, so a trainer that learns it works end to end.
    """
    from PIL import ImageStat

    return [sum(ImageStat.Stat(image.convert("RGB")).mean) / (3 * 255.0) for image in images]


# ---------------------------------------------------------------------------- built-in: vlm_judge

JUDGE_API_KEY_ENV = "GROUPRL_JUDGE_API_KEY"
JUDGE_MODES = ("unified_reward", "ocr", "unified_reward_pointwise", "unified_reward_flow_grpo",
               "unified_reward_pairwise")

UNIFIED_REWARD_PROMPT = (
    "You are judging an image that was generated from a caption.\n"
    "Caption: {prompt}\n\n"
    "Rate how well the image matches the caption: the objects it names and how many there are, "
    "their colours, attributes and positions, any text it asks for, and the image's overall quality. "
    "Explain your reasoning in a few sentences, then end your reply with one line of the form\n"
    "Final Score: x\n"
    "where x is a number from 1 (the image does not match the caption) to 5 (it matches perfectly)."
)
# UnifiedReward's published templates, verbatim (CodeGoat24/UnifiedReward,
# inference_qwen/image_generation/qwen_point_score_image_generation.py and qwen_pair_rank_image_generation.py;
# the same text in its benchmark scripts, benchmark_evaluation/Qwen_evaluation/test_qwen_genAI_bench_image.py).
UNIFIED_REWARD_POINTWISE_PROMPT = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this "
    "image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the "
    "provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as described "
    "in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nExtract key elements from the provided text "
    "caption, evaluate their presence in the generated image using the format: 'element (type): value' (where "
    "value=0 means not generated, and value=1 means generated), and assign a score from 1 to 5 after "
    "'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
UNIFIED_REWARD_PAIRWISE_PROMPT = (
    "You are given a text caption and two generated images based on that caption. Your task is to evaluate and "
    "compare these images based on two key criteria:\n1. Alignment with the Caption: Assess how well each image "
    "aligns with the provided caption. Consider the accuracy of depicted objects, their relationships, and "
    "attributes as described in the caption.\n2. Overall Image Quality: Examine the visual quality of each image, "
    "including clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nCompare both images "
    "using the above criteria and select the one that better aligns with the caption while exhibiting superior "
    "visual quality.\nProvide a clear conclusion such as \"Image 1 is better.\", \"Image 2 is better.\" and "
    "\"Both images are equally good.\"\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
# The template Flow-GRPO trains with against UnifiedReward-7b-v1.5 (flow_grpo/rewards.py,
# unifiedreward_score_sglang), verbatim, its LLaVA "<image>" placeholder included.
UNIFIED_REWARD_FLOW_GRPO_PROMPT = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
    "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
    "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
    "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
    "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
_POINTWISE_PROMPTS = {"unified_reward": UNIFIED_REWARD_PROMPT, "unified_reward_pointwise": UNIFIED_REWARD_POINTWISE_PROMPT,
                      "unified_reward_flow_grpo": UNIFIED_REWARD_FLOW_GRPO_PROMPT}
# The conclusions the pairwise template asks for, as the share of the comparison image 1 wins.
PAIRWISE_VERDICTS = {"image 1 is better": 1.0, "image 2 is better": 0.0, "both images are equally good": 0.5}
_PAIRWISE_VERDICT = re.compile("|".join(re.escape(v) for v in PAIRWISE_VERDICTS), re.IGNORECASE)

OCR_PROMPT = (
    "Read all the text written in this image. Reply with that text exactly as written and nothing "
    "else. If the image holds no text, reply with an empty message."
)

# The last match is the verdict: an earlier one may be the model quoting the instruction.
# Markdown bold around the label or the number ("**Final Score:** 4") is common.
_FINAL_SCORE = re.compile(r"final\s*score\s*\**\s*:\s*\**\s*([0-9]+(?:\.[0-9]+)?)", re.IGNORECASE)


class JudgeError(RewardError):
    """A VLM judge call failed after its retries, or its reply could not be used.

    ``url`` is the endpoint, ``row`` the batch row, ``attempts`` how many requests were
    made, ``status`` the last HTTP status (None when no answer came back).
    """

    def __init__(self, message: str, *, url: str, row: int, attempts: int = 0, status: int | None = None):
        super().__init__(message, reward="vlm_judge", row=row)
        self.url = url
        self.attempts = attempts
        self.status = status


def parse_final_score(reply: str) -> float | None:
    """The number of the last ``Final Score: x`` line of a judge's reply, or None without one."""
    matches = _FINAL_SCORE.findall(reply or "")
    return float(matches[-1]) if matches else None


def unified_reward_score(reply: str, *, row: int, url: str) -> float:
    """x / 5 for a reply ending ``Final Score: x`` with x in [1, 5] (UnifiedReward's scale).

    A reply without a score, or one off the scale, raises :class:`JudgeError` naming the
    row: a judge that did not judge gives no score, never 0.
    """
    x = parse_final_score(reply)
    if x is None:
        raise JudgeError(f"VLM judge {url} gave no 'Final Score: x' line for row {row}; reply: {excerpt(reply)}",
                         url=url, row=row)
    if not 1.0 <= x <= 5.0:
        raise JudgeError(f"VLM judge {url} gave Final Score {x:g} for row {row}, off the 1-5 scale", url=url, row=row)
    return x / 5.0


def parse_pairwise_verdict(reply: str) -> float | None:
    """Image 1's share of a pairwise comparison: 1 for "Image 1 is better", 0 for "Image 2 is better", 0.5 for
    "Both images are equally good" (case-insensitive; the last one in the reply wins, as an earlier one may be
    the model quoting the instruction); None when the reply holds none.

    UnifiedReward's benchmark scripts test ``"Image 1 is better" in reply`` (and the other two) the same way.
    """
    matches = _PAIRWISE_VERDICT.findall(reply or "")
    return PAIRWISE_VERDICTS[matches[-1].lower()] if matches else None


def prompt_groups(prompts: Sequence[str], group_size: int | None = None) -> list[list[int]]:
    """The rows of each group of a batch: consecutive blocks of ``group_size`` rows, or, when None, the maximal
    runs of consecutive rows with the same prompt (a trainer puts a prompt's n samples next to each other).

    Raises ValueError when the batch is not whole groups of ``group_size``, when a group's rows do not share
    one prompt, or when a group has a single row (nothing to compare it with).
    """
    n = len(prompts)
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
            raise ValueError(f"vlm_judge: group_size must be an integer >= 2, got {group_size!r}")
        if n % group_size:
            raise ValueError(f"vlm_judge: pairwise judging got {n} rows, not whole groups of group_size={group_size} "
                             "(score whole groups: a micro-batch size that is a multiple of the group size)")
        groups = [list(range(start, start + group_size)) for start in range(0, n, group_size)]
    else:
        groups = []
        for row in range(n):
            if groups and prompts[groups[-1][-1]] == prompts[row]:
                groups[-1].append(row)
            else:
                groups.append([row])
    for group in groups:
        if len({prompts[row] for row in group}) > 1:
            raise ValueError(f"vlm_judge: rows {group[0]}-{group[-1]} of a group hold different prompts")
        if len(group) < 2:
            raise ValueError(f"vlm_judge: row {group[0]} is the only image of its prompt in the batch: pairwise "
                             "judging needs at least 2 images per prompt")
    return groups


def pairwise_win_rates(n: int, verdicts: Mapping[tuple[int, int], float]) -> list[float | None]:
    """Each row's mean share over its comparisons: sum of s over the pairs it took part in / their number, where
    ``verdicts[(i, j)]`` is the share image i won against j (1, 0.5 or 0) and j's share is 1 - s. None for a
    row in no comparison."""
    won, played = [0.0] * n, [0] * n
    for (first, second), share in verdicts.items():
        won[first] += share
        won[second] += 1.0 - share
        played[first] += 1
        played[second] += 1
    return [won[row] / played[row] if played[row] else None for row in range(n)]


def image_data_url(image: Any) -> str:
    """``data:image/png;base64,...`` of the image encoded as PNG (lossless: the judge sees the pixels scored)."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def judge_messages(data_url: str | Sequence[str], text: str) -> list[dict[str, Any]]:
    """One user message holding the image(s) (as data URLs, in order) and then the instruction."""
    urls = [data_url] if isinstance(data_url, str) else list(data_url)
    return [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": url}} for url in urls),
        {"type": "text", "text": text},
    ]}]


async def vlm_judge_reward(
    images: Sequence[Any], prompts: Sequence[str], *, base_url: str | None = None, model: str = "",
    mode: str = "unified_reward", api_key: str | None = None, text: Sequence[str | None] | None = None,
    timeout: float = 60.0, max_retries: int = 3, retry_backoff: float | None = None, concurrency: int = 8,
    max_tokens: int = 1024, temperature: float = 0.0, group_size: int | None = None, both_orders: bool = True,
    **metadata: Any,
) -> list[float | None]:
    """A VLM judge behind an OpenAI-compatible ``POST {base_url}/chat/completions`` (vLLM, SGLang, a hosted API).

    Each image goes as a PNG data URL in one user message with the instruction of ``mode``:

    - ``unified_reward``: grouprl's own instruction: rate how well the image matches its
      prompt, ending with ``Final Score: x`` (1-5); reward x / 5 (:func:`unified_reward_score`);
    - ``unified_reward_pointwise``: UnifiedReward's published point-score template
      (:data:`UNIFIED_REWARD_POINTWISE_PROMPT`), scored the same way (x / 5);
    - ``unified_reward_flow_grpo``: the template Flow-GRPO trains with
      (:data:`UNIFIED_REWARD_FLOW_GRPO_PROMPT`), x / 5; Flow-GRPO reads the first
      ``Final Score:`` and scores a reply without one 0, here the last one counts and a
      reply without one raises;
    - ``unified_reward_pairwise``: UnifiedReward's published pair-rank template
      (:data:`UNIFIED_REWARD_PAIRWISE_PROMPT`) on two images of the same prompt, first
      then second; the reply's conclusion (:func:`parse_pairwise_verdict`) gives image 1
      the share 1 (better), 0.5 (equally good) or 0. Within each group
      (:func:`prompt_groups`: blocks of ``group_size`` rows, or else the runs of
      consecutive rows with one prompt) every pair is judged, in both orders when
      ``both_orders`` (cancelling the judge's position bias; k(k-1) requests for a group
      of k, else k(k-1)/2); a row's reward is its mean share over its comparisons
      (:func:`pairwise_win_rates`), in [0, 1]. A batch holding a single image of a prompt
      raises: there is nothing to compare it with;
    - ``ocr``: read the text in the image; reward :func:`ocr_score` of the reply against
      the target (:func:`ocr_targets`: the ``text`` column or the prompt's quoted text;
      a row without one gets None and is not sent).

    The bearer key is ``api_key`` or ``$GROUPRL_JUDGE_API_KEY`` (neither: no
    Authorization header). Requests go through the ``openai`` SDK
    (:class:`grouprl.rewards.chat_endpoint.ChatEndpoint`); at most ``concurrency`` are
    in flight; each gets ``timeout`` seconds and is retried up to ``max_retries`` times
    on timeouts, connection errors, 408, 409, 429 and 5xx, after the server's
    ``Retry-After`` or else 0.5 s doubling up to 8 s (``retry_backoff`` is no longer
    accepted: the SDK sets the back-off). A call still failing, another HTTP error or
    an unusable reply raises :class:`JudgeError` naming the URL and the row (the first
    failure cancels the batch's other requests).
    """
    if mode not in JUDGE_MODES:
        raise ValueError(f"vlm_judge: mode must be one of {', '.join(JUDGE_MODES)}, got {mode!r}")
    if not base_url:
        raise ValueError("vlm_judge needs the option 'base_url' (e.g. http://host:8000/v1)")
    if retry_backoff is not None:
        raise ValueError("vlm_judge: the option 'retry_backoff' is no longer supported: retries wait as the openai "
                         "client does (the server's Retry-After, else 0.5 s doubling up to 8 s); remove it, and "
                         "bound the retries with 'max_retries' and 'timeout'")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"vlm_judge: concurrency must be a positive integer, got {concurrency!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"vlm_judge: max_retries must be a non-negative integer, got {max_retries!r}")
    if group_size is not None and mode != "unified_reward_pairwise":
        raise ValueError(f"vlm_judge: group_size is an option of mode 'unified_reward_pairwise', not of {mode!r}")
    groups = prompt_groups(prompts, group_size) if mode == "unified_reward_pairwise" else []
    key = api_key if api_key is not None else os.environ.get(JUDGE_API_KEY_ENV) or None
    endpoint = ChatEndpoint(base_url, api_key=key, timeout=timeout, max_retries=max_retries, connections=concurrency,
                            extra="judge", user="the 'vlm_judge' image reward")
    url = endpoint.url
    targets = ocr_targets(prompts, text) if mode == "ocr" else [None] * len(images)
    limit = asyncio.Semaphore(concurrency)
    data_urls: dict[int, asyncio.Future] = {}

    async def data_url(row: int) -> str:
        # Once per image: pairwise judging shows each image in many requests.
        if row not in data_urls:
            # PNG encoding takes milliseconds per image: off the loop, so requests keep flowing.
            data_urls[row] = asyncio.ensure_future(asyncio.to_thread(image_data_url, images[row]))
        return await data_urls[row]

    async def ask(row: int, rows: Sequence[int], instruction: str) -> str:
        """The judge's reply to the images of ``rows`` and ``instruction``; errors name ``row``."""
        async with limit:
            urls = [await data_url(r) for r in rows]
            body = {"model": model, "messages": judge_messages(urls, instruction),
                    "max_tokens": max_tokens, "temperature": temperature}
            try:
                reply = await endpoint.acomplete(body)
            except UnusableReply as exc:
                raise JudgeError(f"VLM judge {url} answered row {row} without a reply text: {exc}", url=url,
                                 row=row, attempts=exc.attempts, status=exc.status) from None
            except ChatCallError as exc:
                what = (f"refused row {row}" if exc.refused else
                        f"failed for row {row} after {exc.attempts} attempt(s) "
                        f"(last status {exc.status if exc.status is not None else 'none'})")
                raise JudgeError(f"VLM judge {url} {what}: {exc}", url=url, row=row, attempts=exc.attempts,
                                 status=exc.status) from None
        return reply.text

    async def one(row: int) -> float | None:
        if mode == "ocr":
            if targets[row] is None:
                return None
            return ocr_score(await ask(row, [row], OCR_PROMPT), targets[row])
        reply = await ask(row, [row], _POINTWISE_PROMPTS[mode].format(prompt=prompts[row]))
        return unified_reward_score(reply, row=row, url=url)

    async def compare(first: int, second: int) -> float:
        reply = await ask(first, [first, second], UNIFIED_REWARD_PAIRWISE_PROMPT.format(prompt=prompts[first]))
        share = parse_pairwise_verdict(reply)
        if share is None:
            raise JudgeError(f"VLM judge {url} gave no verdict ('Image 1 is better.', 'Image 2 is better.' or "
                             f"'Both images are equally good.') comparing rows {first} and {second}; reply: "
                             f"{excerpt(reply)}", url=url, row=first)
        return share

    pairs = [(i, j) for group in groups for a, i in enumerate(group) for j in group[a + 1:]]
    if both_orders:
        pairs += [(j, i) for i, j in pairs]
    try:
        if mode == "unified_reward_pairwise":
            tasks = [asyncio.ensure_future(compare(i, j)) for i, j in pairs]
        else:
            tasks = [asyncio.ensure_future(one(row)) for row in range(len(images))]
        try:
            outcomes = list(await asyncio.gather(*tasks))
        except BaseException:
            # The first failure decides the batch: stop the other requests' retries too.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if mode != "unified_reward_pairwise":
            return outcomes
        # (i, j) and (j, i) are two comparisons: each counts once for both images.
        return pairwise_win_rates(len(images), dict(zip(pairs, outcomes)))
    finally:
        await endpoint.aclose()


def shapes_task_reward(images: list[Any], prompts: list[str], **metadata: Any) -> list[float]:
    """The synthetic shapes task's rule reward (``grouprl.domains.diffusion.shapes.shapes_reward``): colour,
    position and count read from the pixels, in [0, 1]; registered as ``shapes`` so configs can name it."""
    from grouprl.domains.diffusion.shapes import shapes_reward

    return shapes_reward(images, prompts, **metadata)
