"""GREEN (Ostmeier et al. 2024): an LLM judge counts a candidate report's clinical errors.

For each (candidate, reference) pair a judge model served behind any OpenAI-compatible
chat endpoint (``POST {base_url}/chat/completions``: vLLM serving
GREEN-RadLlama2-7b, a general instruction model, a hosted API) is asked for the
findings both reports share ("matched findings") and for the candidate's clinically
significant errors in six categories:

    (a) false report of a finding        (b) missing a finding of the reference
    (c) wrong anatomic location          (d) wrong severity
    (e) comparison not in the reference  (f) omitted comparison with a prior study

plus clinically insignificant errors. Then

    GREEN = matched / (matched + a + b + c + d + e + f)

and, following the GREEN reference implementation, GREEN = 0 whenever there are no
matched findings (also when there are no errors either), so scores are comparable
with published GREEN numbers. The counts are kept next to the score
(:class:`GreenResult`), so that "nothing to match" can be told apart when it matters.

The judge is asked for GREEN's section layout (``[Clinically Significant Errors]:``
with ``(a) ...: <count>.`` lines, ``[Matched Findings]: <count>. ...``), which the
fine-tuned GREEN models produce; :func:`parse_green_reply` also reads markdown
variants, numbered categories, number words and a JSON object. A reply that cannot be
parsed is retried and then raises :class:`GreenError`: a judge failure never becomes a
score of 0. The requests go through :class:`grouprl.rewards.judge.ChatJudge` (the
``openai`` SDK): connection errors, timeouts and HTTP 408/409/429/5xx are retried
(after the server's Retry-After, else 0.5 s doubling up to 8 s), unusable replies are
asked again after ``backoff * 2 ** (k - 1)`` seconds; other HTTP errors (401, 404, ...)
raise at once. Identical pairs in a batch are judged once; at most ``concurrency``
requests are in flight. Needs ``openai`` and ``httpx`` (``pip install 'grouprl[green]'``).

The registered ``green`` component reads its endpoint from the environment:
``GROUPRL_GREEN_BASE_URL`` (e.g. ``http://127.0.0.1:8000/v1``), ``GROUPRL_GREEN_MODEL``
and optionally ``GROUPRL_GREEN_API_KEY``. A judge takes seconds per report, so GREEN
is an evaluation metric more than a per-step reward.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from grouprl.rewards.chat_endpoint import require_openai
from grouprl.rewards.judge import ChatJudge, JudgeError
from grouprl.domains.radiology.rewards.components import register_component

SIGNIFICANT_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("false_finding", "False report of a finding in the candidate"),
    ("missing_finding", "Missing a finding present in the reference"),
    ("wrong_location", "Misidentification of a finding's anatomic location/position"),
    ("wrong_severity", "Misassessment of the severity of a finding"),
    ("false_comparison", "Mentioning a comparison that isn't in the reference"),
    ("omitted_comparison", "Omitting a comparison detailing a change from a prior study"),
)
CATEGORY_KEYS = tuple(key for key, _ in SIGNIFICANT_CATEGORIES)


class GreenError(RuntimeError):
    """The judge could not be reached, refused the request, or gave no usable reply."""


class GreenParseError(ValueError):
    """A judge reply without the counts GREEN needs."""


# ---------------------------------------------------------------- prompt


SYSTEM_PROMPT = "You are an experienced radiologist who checks chest X-ray reports for clinical errors."


def judge_messages(reference: str, candidate: str) -> list[dict[str, str]]:
    """The chat messages asking the judge to compare ``candidate`` with ``reference``."""
    lines = "\n".join(f"({chr(97 + i)}) {label}" for i, (_, label) in enumerate(SIGNIFICANT_CATEGORIES))
    layout_errors = "\n".join(
        f"({chr(97 + i)}) {label}: <count>. <error 1>; <error 2>; ..."
        for i, (_, label) in enumerate(SIGNIFICANT_CATEGORIES)
    )
    user = (
        "Compare a candidate chest X-ray report with a reference report written by a radiologist. "
        "Judge the clinical findings only, not the wording or the style.\n\n"
        "Count the candidate's clinically significant errors in these six categories:\n"
        f"{lines}\n"
        "Errors that would not change the patient's care are clinically insignificant errors; count them "
        "in the same categories. Also count the findings on which both reports agree (matched findings).\n\n"
        f"Reference report:\n{reference.strip()}\n\n"
        f"Candidate report:\n{candidate.strip()}\n\n"
        "Answer in exactly this layout and give every category, also when its count is 0:\n\n"
        "[Explanation]:\n<a short explanation>\n\n"
        f"[Clinically Significant Errors]:\n{layout_errors}\n\n"
        f"[Clinically Insignificant Errors]:\n{layout_errors}\n\n"
        "[Matched Findings]:\n<count>. <finding 1>; <finding 2>; ..."
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


# ---------------------------------------------------------------- parsing


@dataclass(frozen=True)
class GreenCounts:
    """What the judge found: matched findings, the six significant error counts (a..f),
    and the insignificant error total (None when the reply does not give it)."""

    matched: int
    significant: tuple[int, int, int, int, int, int]
    insignificant: int | None = None

    @property
    def significant_total(self) -> int:
        return sum(self.significant)

    @property
    def score(self) -> float:
        return green_from_counts(self.matched, self.significant)

    def as_dict(self) -> dict[str, Any]:
        return {"matched_findings": self.matched, **dict(zip(CATEGORY_KEYS, self.significant)),
                "insignificant_errors": self.insignificant}


def green_from_counts(matched: int, significant: Sequence[int]) -> float:
    """matched / (matched + sum(significant)); 0 when nothing matched (GREEN's convention)."""
    if matched < 0 or any(c < 0 for c in significant):
        raise ValueError(f"counts must be non-negative, got matched={matched}, significant={list(significant)}")
    if matched == 0:
        return 0.0
    return matched / (matched + sum(significant))


_NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}
_NONE_WORDS = re.compile(r"^\s*(?:no|none|nil|n/?a|zero|not applicable|there (?:are|were) no)\b", re.I)
_NUMBER = r"(\d+|" + "|".join(_NUMBER_WORDS) + r"|no|none)"
_SECTION = re.compile(
    r"^[ \t]*(?:[-*][ \t]*)?(?:\[[ \t]*(?P<b>{names})[ \t]*\][ \t]*:?|(?P<c>{names})[ \t]*:)".format(
        names=r"explanation|clinically\s+significant\s+errors?|clinically\s+insignificant\s+errors?"
        r"|matched\s+findings?"
    ),
    re.I | re.M,
)
_ITEM = re.compile(r"^[ \t]*(?:[-*][ \t]*)?(?:(\()([a-f1-6])\)|([a-f1-6])([).]))[ \t]*(.*)$", re.I | re.M)
_COUNT_AFTER_COLON = re.compile(r"[:=\-\u2013][ \t]*" + _NUMBER + r"\b", re.I)
_LEADING_COUNT = re.compile(r"^[ \t]*" + _NUMBER + r"\b", re.I)


def _as_int(token: str) -> int:
    token = token.lower()
    if token.isdigit():
        return int(token)
    if token in ("no", "none"):
        return 0
    return _NUMBER_WORDS[token]


def _clean_reply(text: str) -> str:
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.S | re.I)
    text = text.replace("**", "").replace("__", "").replace("`", "")
    return re.sub(r"^[ \t]*#+[ \t]*", "", text, flags=re.M)


def _sections(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    matches = list(_SECTION.finditer(text))
    for i, m in enumerate(matches):
        name = re.sub(r"\s+", " ", (m.group("b") or m.group("c")).lower())
        name = {"clinically significant error": "clinically significant errors",
                "clinically insignificant error": "clinically insignificant errors",
                "matched finding": "matched findings"}.get(name, name)
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        found.setdefault(name, text[m.end() : end].strip())
    return found


def _category_counts(content: str, section: str) -> tuple[int, ...]:
    counts = [0] * 6
    # (key, parenthesised, text) per line that starts like a category; the most
    # specific form wins, so that "1. <error>" lines listing the errors of "(a) ...: 2."
    # (or a sentence starting "e.g.") are not read as categories.
    found = [((p_key or bare_key).lower(), "()" if paren else closer, rest)
             for paren, p_key, bare_key, closer, rest in _ITEM.findall(content)]
    items: list[tuple[str, str]] = []
    for want_letter in (True, False):
        for want_form in ("()", ")", "."):
            items = [(k, rest) for k, form, rest in found if k.isalpha() == want_letter and form == want_form]
            if items:
                break
        if items:
            break
    if not items:
        if _NONE_WORDS.match(content) and not re.search(r"\d", content):
            return tuple(counts)
        raise GreenParseError(f"no (a)..(f) error counts under [{section}]: {content[:200]!r}")
    seen: set[int] = set()
    for key, rest in items:
        index = int(key) - 1 if key.isdigit() else ord(key) - 97
        if index in seen:  # the first line of a category gives its count
            continue
        seen.add(index)
        m = _COUNT_AFTER_COLON.search(rest) or re.search(r"\b(\d+)\b", rest)
        if m is None:
            if _NONE_WORDS.search(rest):
                continue
            raise GreenParseError(f"no count in line {rest[:120]!r} under [{section}]")
        counts[index] = _as_int(m.group(1))
    return tuple(counts)


def _matched_count(content: str) -> int:
    m = _LEADING_COUNT.match(content)
    if m:
        return _as_int(m.group(1))
    if _NONE_WORDS.match(content):
        return 0
    raise GreenParseError(f"no count of matched findings in {content[:200]!r}")


def _from_json(text: str) -> GreenCounts | None:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    try:
        data = json.loads(text[start : end + 1])
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    data = {str(k).lower().replace(" ", "_"): v for k, v in data.items()}
    matched = data.get("matched_findings", data.get("matched"))
    significant = data.get("clinically_significant_errors", data.get("significant_errors"))
    if matched is None or significant is None:
        return None

    def number(v: Any) -> int:
        if isinstance(v, bool) or v is None:
            raise GreenParseError(f"not a count: {v!r}")
        if isinstance(v, (int, float)) and v >= 0 and float(v).is_integer():
            return int(v)
        if isinstance(v, list):  # a list of the errors themselves
            return len(v)
        if isinstance(v, dict) and "count" in v:
            return number(v["count"])
        if isinstance(v, str):
            word = v.strip().lower()
            if word.isdigit() or word in _NUMBER_WORDS or word in ("no", "none"):
                return _as_int(word)
        raise GreenParseError(f"not a count: {v!r}")

    if isinstance(significant, list) and len(significant) == 6:
        counts = tuple(number(v) for v in significant)
    elif isinstance(significant, dict):
        counts_list = [0] * 6
        for key, value in significant.items():
            k = str(key).strip().lower().strip("()")
            if k in CATEGORY_KEYS:
                index = CATEGORY_KEYS.index(k)
            elif len(k) >= 1 and k[0] in "abcdef" and (len(k) == 1 or not k[1].isalpha()):
                index = ord(k[0]) - 97
            elif k[:1] in "123456" and (len(k) == 1 or not k[1].isdigit()):
                index = int(k[0]) - 1
            else:
                raise GreenParseError(f"unknown error category {key!r}")
            counts_list[index] = number(value)
        counts = tuple(counts_list)
    else:
        raise GreenParseError(f"significant errors must be 6 counts or a mapping, got {significant!r}")
    insignificant = data.get("clinically_insignificant_errors", data.get("insignificant_errors"))
    if isinstance(insignificant, dict):
        insignificant = sum(number(v) for v in insignificant.values())
    elif isinstance(insignificant, list) and len(insignificant) == 6:
        insignificant = sum(number(v) for v in insignificant)
    elif insignificant is not None:
        insignificant = number(insignificant)
    return GreenCounts(number(matched), counts, insignificant)  # type: ignore[arg-type]


def parse_green_reply(text: str) -> GreenCounts:
    """The counts in a judge reply; raises :class:`GreenParseError` when they are not all there.

    Reads GREEN's layout (``[Clinically Significant Errors]:`` then ``(a) ...: 1.`` lines,
    ``[Matched Findings]: 2. ...``), with or without brackets, markdown emphasis or
    headings, numbered (1)-(6) instead of lettered categories, number words ("two"),
    "No errors." for a section without errors; a ``<think>`` block is ignored. Failing
    that, a JSON object with ``matched_findings`` and ``significant_errors`` (six counts,
    or a mapping by letter or by :data:`CATEGORY_KEYS`). A category a sectioned reply
    leaves out counts 0, as in GREEN's own parser.
    """
    if not isinstance(text, str) or not text.strip():
        raise GreenParseError("empty judge reply")
    cleaned = _clean_reply(text)
    sections = _sections(cleaned)
    significant = sections.get("clinically significant errors")
    matched = sections.get("matched findings")
    if significant is None or matched is None:
        from_json = _from_json(cleaned)
        if from_json is not None:
            return from_json
        missing = [n for n, v in (("Clinically Significant Errors", significant), ("Matched Findings", matched))
                   if v is None]
        raise GreenParseError(f"judge reply has no {' or '.join(missing)} section: {text[:300]!r}")
    counts = _category_counts(significant, "Clinically Significant Errors")
    insignificant: int | None = None
    if "clinically insignificant errors" in sections:
        try:
            insignificant = sum(_category_counts(sections["clinically insignificant errors"],
                                                 "Clinically Insignificant Errors"))
        except GreenParseError:
            insignificant = None  # not part of the score; an odd layout there is not fatal
    return GreenCounts(_matched_count(matched), counts, insignificant)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the judge client


@dataclass
class GreenResult:
    """One pair's GREEN score, the counts behind it and the judge's reply."""

    score: float
    counts: GreenCounts
    reply: str


@dataclass
class GreenJudge:
    """A GREEN judge behind an OpenAI-compatible chat endpoint.

    ``base_url`` is the API root (``http://127.0.0.1:8000/v1``); requests go to
    ``{base_url}/chat/completions`` with ``Authorization: Bearer {api_key}`` when a key
    is given, through a :class:`grouprl.rewards.judge.ChatJudge`. ``max_retries`` is the
    number of further attempts after the first one, shared by transient failures
    (retried by the ``openai`` SDK: the server's Retry-After, else 0.5 s doubling up to
    8 s) and unusable replies (asked again after ``backoff * 2 ** (k - 1)`` seconds).
    """

    base_url: str
    model: str
    api_key: str | None = None
    timeout: float = 120.0
    max_retries: int = 3
    backoff: float = 1.0
    concurrency: int = 8
    temperature: float = 0.0
    max_tokens: int = 1024
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_url or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.model:
            raise ValueError("the judge model name is empty")
        if self.max_retries < 0 or self.concurrency < 1 or self.timeout <= 0 or self.backoff < 0:
            raise ValueError("need max_retries >= 0, concurrency >= 1, timeout > 0 and backoff >= 0")
        self.base_url = self.base_url.rstrip("/")
        require_openai("GREEN", "green")
        # api_key "" and no variable: the key is api_key or none (judge_from_env reads GROUPRL_GREEN_API_KEY)
        self._judge = ChatJudge(self.base_url, self.model, api_key=self.api_key or "", api_key_env="",
                                timeout=self.timeout, max_retries=self.max_retries, backoff=self.backoff,
                                concurrency=self.concurrency, temperature=self.temperature,
                                max_tokens=self.max_tokens, extra_body=dict(self.extra_body))

    @property
    def backend(self) -> str:
        return f"green=LLM judge {self.model} at {self.base_url}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def close(self) -> None:
        self._judge.close()

    def __enter__(self) -> "GreenJudge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def judge(self, candidate: str, reference: str) -> GreenResult:
        """Ask the judge about one pair (with retries); raises :class:`GreenError` when it stays unusable."""
        try:
            counts, reply = self._judge.judge(judge_messages(reference, candidate), parse_green_reply,
                                              item="the pair")
        except JudgeError as exc:
            raise self._error(exc) from None
        return GreenResult(counts.score, counts, reply)

    def _error(self, exc: JudgeError) -> GreenError:
        if exc.refused:
            return GreenError(f"GREEN judge at {self.url} refused the request for {exc.item}: {exc.error}")
        return GreenError(f"GREEN judge at {self.url} (model {self.model}) failed after {exc.attempts} attempts "
                          f"for {exc.item}; last error: {exc.error}")

    def score(self, hyps: Sequence[str], refs: Sequence[str]) -> list[GreenResult]:
        """Judge each (hypothesis, reference) pair; identical pairs are judged once.

        Raises :class:`GreenError` as soon as one pair fails after its retries.
        """
        if len(hyps) != len(refs):
            raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
        for text in (*hyps, *refs):
            if not isinstance(text, str):
                raise TypeError(f"reports must be strings, got {type(text).__name__}")
        first_row: dict[tuple[str, str], int] = {}
        for row, pair in enumerate(zip(hyps, refs)):
            first_row.setdefault(pair, row)
        pairs = list(first_row)
        if not pairs:
            return []
        try:
            judged = self._judge.judge_many([judge_messages(ref, hyp) for hyp, ref in pairs], parse_green_reply,
                                            items=[f"row {first_row[pair]}" for pair in pairs])
        except JudgeError as exc:
            raise self._error(exc) from None
        results = {pair: GreenResult(j.value.score, j.value, j.reply) for pair, j in zip(pairs, judged)}
        return [results[pair] for pair in zip(hyps, refs)]


def green_summary(results: Sequence[GreenResult]) -> dict[str, Any]:
    """Mean GREEN, mean count per error category and of matched findings, over ``results``."""
    if not results:
        raise ValueError("no GREEN results to summarise")
    n = len(results)
    summary: dict[str, Any] = {"green": sum(r.score for r in results) / n}
    for i, key in enumerate(CATEGORY_KEYS):
        summary[key] = sum(r.counts.significant[i] for r in results) / n
    summary["matched_findings"] = sum(r.counts.matched for r in results) / n
    given = [r.counts.insignificant for r in results if r.counts.insignificant is not None]
    summary["insignificant_errors"] = sum(given) / len(given) if given else None
    return summary


def judge_from_env() -> GreenJudge:
    """The judge configured by GROUPRL_GREEN_BASE_URL, GROUPRL_GREEN_MODEL and GROUPRL_GREEN_API_KEY."""
    base_url = os.environ.get("GROUPRL_GREEN_BASE_URL", "").strip()
    model = os.environ.get("GROUPRL_GREEN_MODEL", "").strip()
    if not base_url or not model:
        raise GreenError(
            "the 'green' component needs a judge endpoint: set GROUPRL_GREEN_BASE_URL (an OpenAI-compatible "
            "API root such as http://127.0.0.1:8000/v1) and GROUPRL_GREEN_MODEL (the served model name), "
            "and GROUPRL_GREEN_API_KEY if the endpoint wants a key"
        )
    return GreenJudge(base_url, model, api_key=os.environ.get("GROUPRL_GREEN_API_KEY") or None)


@register_component("green", backend="green=LLM judge via an OpenAI-compatible endpoint (GROUPRL_GREEN_MODEL)")
def green_component(hyps: list[str], refs: list[str]) -> list[float]:
    """GREEN from the judge configured in the environment (GROUPRL_GREEN_*)."""
    with judge_from_env() as judge:
        return [r.score for r in judge.score(hyps, refs)]
