"""RadVLM-GRPO's reward-worker protocol, served by grouprl's reward server.

RadVLM-GRPO's training reward functions post one pair per request::

    POST /score_radcliq    {"pred_text": "...", "true_text": "..."}  ->  200 {"score": -0.87}
    POST /score_bertscore  (same body)                                ->  200 {"score": 0.41}
    POST /score_radgraph   (same body)                                ->  200 {"score": 0.33}

and read only ``score`` (any non-200 answer raises on their side; 429 and 5xx are
retried). Each route scores with a grouprl report score component (:data:`ENDPOINTS`)
and keeps the seed's worker behaviour:

- either text of 5 characters or fewer (counted before anything is cut) scores the
  route's fallback, -3 for RadCliQ and 0 for the others, without scoring;
- otherwise both texts are cut to their first 2,048 characters and then lowercased,
  in that order, and scored;
- ``/score_radcliq`` answers -RadCliQ-v1 (the seed's reward: lower RadCliQ is better),
  ``/score_radgraph`` RadGraph F1 at the complete level (the seed's worker reads the
  third value of ``reward_level="all"``), ``/score_bertscore`` BERTScore F1;
- a scoring error scores the fallback too: that is the seed's contract with its
  training loop. Unlike the seed's workers, which print it, the server logs one
  warning line naming the error, counts it (``GET /health``, ``radvlm.fallbacks``)
  and says so in the answer.

The answer adds ``fallback`` (None, ``"too_short"`` or ``"error"``), ``error`` (the
error's type and message, on an error) and ``backend`` to ``score``; RadVLM's client
ignores them. The components are grouprl's stand-ins (rule-based RadGraph, MiniLM
BERTScore without baseline rescaling), so values differ from the seed's models and
``backend`` says which produced them.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MIN_CHARS = 5  # a text this long or shorter is not scored
MAX_CHARS = 2048  # texts are cut to this many characters before scoring

TOO_SHORT = "too_short"
ERROR = "error"


@dataclass(frozen=True)
class Endpoint:
    """One RadVLM worker route: the component it scores with and the score it falls back to."""

    path: str
    component: str
    fallback: float


ENDPOINTS: dict[str, Endpoint] = {
    e.path: e for e in (
        Endpoint("/score_radcliq", "neg_radcliq", -3.0),
        Endpoint("/score_bertscore", "bertscore", 0.0),
        Endpoint("/score_radgraph", "radgraph_complete", 0.0),
    )
}


def parse_score_request(payload: Mapping[str, Any]) -> tuple[str, str]:
    """``{"pred_text", "true_text"}`` -> the two texts; ValueError naming a missing or non-string key."""
    texts = []
    for key in ("pred_text", "true_text"):
        if key not in payload:
            raise ValueError(f"missing {key!r} in request (RadVLM's body is {{\"pred_text\": ..., \"true_text\": ...}})")
        value = payload[key]
        if not isinstance(value, str):
            raise ValueError(f"{key!r} must be a string, got {type(value).__name__ if value is not None else 'null'}")
        texts.append(value)
    return texts[0], texts[1]


def prepare_texts(pred_text: str, true_text: str) -> tuple[str, str] | None:
    """The texts RadVLM's workers score, or None when either is too short to score.

    The length check sees the texts as sent; then each is cut to :data:`MAX_CHARS`
    characters and lowercased (cut first, as the seed does).
    """
    if len(pred_text) <= MIN_CHARS or len(true_text) <= MIN_CHARS:
        return None
    return pred_text[:MAX_CHARS].lower(), true_text[:MAX_CHARS].lower()


class FallbackCounter:
    """Thread-safe counts of fallback scores per route and reason (this process only)."""

    def __init__(self, paths):
        self._lock = threading.Lock()
        self._counts = {p: {TOO_SHORT: 0, ERROR: 0} for p in paths}

    def add(self, path: str, reason: str) -> None:
        with self._lock:
            self._counts[path][reason] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {p: dict(c) for p, c in self._counts.items()}


def score_pair(endpoint: Endpoint, component, pred_text: str, true_text: str,
               counter: FallbackCounter | None = None) -> dict[str, Any]:
    """The answer of ``endpoint`` to one pair: ``{"score", "fallback", "backend"}`` (+ ``error``).

    ``component`` is the registry entry (``fn(hyps, refs)``, ``backend``). The route's
    sign is the component's: ``neg_radcliq`` is already -RadCliQ-v1.
    """
    backend = component.backend
    texts = prepare_texts(pred_text, true_text)
    if texts is None:
        if counter is not None:
            counter.add(endpoint.path, TOO_SHORT)
        logger.debug("%s: a text of %d characters or fewer scores %s", endpoint.path, MIN_CHARS, endpoint.fallback)
        return {"score": endpoint.fallback, "fallback": TOO_SHORT, "backend": backend}
    try:
        value = _one_score(component, *texts)
    except Exception as exc:  # the seed's contract: a scoring error scores the fallback (logged and counted here)
        message = f"{type(exc).__name__}: {exc}"
        if counter is not None:
            counter.add(endpoint.path, ERROR)
        logger.warning("%s: scoring with %s failed, answering the fallback %s: %s", endpoint.path,
                       endpoint.component, endpoint.fallback, message)
        return {"score": endpoint.fallback, "fallback": ERROR, "error": message, "backend": backend}
    return {"score": value, "fallback": None, "backend": backend}


def _one_score(component, pred: str, true: str) -> float:
    fn: Callable = component.fn
    values = list(fn([pred], [true]))
    if len(values) != 1:
        raise ValueError(f"component {component.name!r} returned {len(values)} scores for 1 pair")
    value = float(values[0])
    if not math.isfinite(value):
        raise ValueError(f"component {component.name!r} returned a non-finite score ({value})")
    return value
