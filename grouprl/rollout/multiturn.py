"""Verifier-guided multi-turn rollouts (Guided-GRPO), built in token space.

Each sampled response becomes a dialogue: the policy answers, a verifier replies
(a correction, a hint, or STOP), the policy answers again, ... for at most
``max_turns`` policy turns of at most ``max_tokens_per_turn`` tokens each (and, when
set, ``max_dialogue_tokens`` response tokens in all). A turn cut off at its token
limit is answered by the verifier like any other and the dialogue goes on (the
seed's behaviour). A dialogue ends when the verifier says STOP and the
last policy turn holds a final answer (exactly one ``<answer>`` with exactly one
``\\boxed{}``); a STOP without one asks the policy to continue and answer in that
format. A verifier that fails is counted, and under ``on_failure: stop`` its
silence is a STOP (the seed's behaviour, here never silent). After
``max_consecutive_failures`` failed calls in a row the verifier is taken as down for
the rest of the call: every open dialogue ends (stop reason ``verifier_failure``) and
one warning names the verifier, rather than each dialogue asking a dead server again,
through its retries and timeouts, for every turn up to ``max_turns``.

The trajectory lives in token space. The policy's sampled ids are kept exactly as
sampled; only the text between turns is tokenized (the end of the assistant's
turn, the verifier's reply as a user message, the next assistant header, all
rendered by the model's own chat template); and the next turn is generated from
exactly the ids that will be trained on (``EncodedPrompt``). So what the policy was
conditioned on is what it is trained on, earlier verifier messages included (the
seed dropped them from the context but trained on them). Positions come from the
model itself over the whole sequence: Qwen-VL's M-RoPE indices are computed from
the full ids and their images on every forward, in generation and in training.

Dialogues of a batch advance turn by turn together: each turn is one engine call
for the dialogues still open, and finished ones drop out.

``train_scope``: ``full_turn`` trains every policy turn (the response is the whole
dialogue after the first prompt; template and verifier tokens have attention but
no loss); ``final_turn`` trains the last policy turn alone, its prompt the whole
dialogue before it (as the seed originally did).

``turn_credit: mask_fixed`` (with ``full_turn``) takes the policy turns before the last out of the
loss in a dialogue the verifier stopped on an accepted answer: the reward is the fixed answer's,
and the earlier, wrong turns did not earn it (``shared``, the seed's, trains them with it too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from grouprl.data.sample import Sample
from grouprl.models.inputs import left_pad, tokenizer_of
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.engine import EncodedPrompt, SamplingParams

logger = logging.getLogger(__name__)

STOP_REASONS = ("stop", "max_turns", "verifier_failure", "length")
_MARK = "\u2063grouprl-turn-mark\u2063"  # stands for an assistant turn while the template renders around it


@dataclass
class Segment:
    """A stretch of a dialogue's response: a policy turn (sampled) or the text between turns."""

    ids: torch.Tensor  # [L] long
    policy: bool
    log_probs: torch.Tensor | None = None  # [L], the sampler's, for policy turns when asked for
    text: str = ""


@dataclass
class Dialogue:
    sample: Sample
    group: int
    prompt: EncodedPrompt
    segments: list[Segment] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)  # the policy's turns, decoded
    replies: list = field(default_factory=list)  # VerifierReply after each policy turn
    stop_reason: str | None = None
    truncated: bool = False  # the last policy turn ran out of tokens before its end-of-turn token

    @property
    def response_tokens(self) -> int:
        """Tokens of the response so far: policy turns and the text between them."""
        return sum(len(s.ids) for s in self.segments)

    @property
    def open(self) -> bool:
        return self.stop_reason is None

    def context(self) -> EncodedPrompt:
        """What the next turn is generated from: the first prompt and everything since, in token space."""
        ids = torch.cat([self.prompt.ids, *[s.ids for s in self.segments]])
        return EncodedPrompt(ids, self.prompt.model_inputs)

    def hallucination_score(self) -> float:
        """Mean of the [SCORE] values the verifier gave (0.5 when it gave none), as the seed computes it."""
        scores = [r.score for r in self.replies if r.score is not None and not r.stop]
        return sum(scores) / len(scores) if scores else 0.5


# tokens a chat template writes around one verifier reply (end of turn, role headers); generous
TEMPLATE_TOKENS_PER_TURN = 32


def max_tokens_per_turn(max_response_length: int, verifier_config) -> int:
    """The most tokens of one policy turn: ``max_tokens_per_turn``, or ``data.max_response_length`` when None."""
    per_turn = verifier_config.max_tokens_per_turn
    return max_response_length if per_turn is None else per_turn


def dialogue_response_budget(max_response_length: int, verifier_config) -> int:
    """The most response tokens an engine must hold for one dialogue: ``max_turns`` policy turns of
    at most ``max_tokens_per_turn`` tokens, and a verifier reply of at most ``max_tokens`` (with the
    template around it) between each two; with ``max_dialogue_tokens`` set, no more than that limit
    plus one turn (the last turn is sampled with a whole turn's room and cut at the limit). An
    engine sizes its context with it."""
    per_turn = max_tokens_per_turn(max_response_length, verifier_config)
    turns = verifier_config.max_turns
    between = verifier_config.max_tokens + TEMPLATE_TOKENS_PER_TURN
    budget = turns * per_turn + (turns - 1) * between
    if verifier_config.max_dialogue_tokens is not None:
        budget = min(budget, verifier_config.max_dialogue_tokens + per_turn)
    return budget


def problem_text(sample: Sample) -> str:
    """The first user message's text, images shown as ``[IMAGE]``: all the verifier sees of the problem.

    As the seed flattens it: the parts (text, ``[IMAGE]``, ``[VIDEO]``) joined by newlines,
    empty parts left out.
    """
    placeholders = {"image": "[IMAGE]", "video": "[VIDEO]"}
    for message in sample.messages:
        if message["role"] != "user":
            continue
        content = message["content"]
        if isinstance(content, str):
            return content
        parts = [placeholders.get(item.get("type"), item.get("text", "") if item.get("type") == "text" else "")
                 for item in content]
        return "\n".join(part for part in parts if part)
    return ""


def turn_boundary_ids(processor, message: str, *, after_end_of_turn: bool,
                      chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids between two policy turns: the end of the assistant turn, ``message`` as a user
    turn, and the next assistant header, exactly as the model's chat template renders them
    (with ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``).

    The template is rendered around a stand-in assistant turn followed by ``message`` and the
    generation prompt, and only what follows the stand-in is tokenized, so the policy's own
    sampled ids are never re-encoded. When the turn ended with its end-of-turn token (sampled),
    that token is not repeated.
    """
    renderer = processor if getattr(processor, "chat_template", None) else tokenizer_of(processor)
    tokenizer = tokenizer_of(processor)
    # How the template renders the turns before the stand-in does not matter (the dialogue keeps the
    # ids it has), and may change once a user turn follows: Qwen3 writes an empty <think></think>
    # block into the last assistant turn only.
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK},
                {"role": "user", "content": message}]
    rendered = renderer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                            **(chat_template_kwargs or {}))
    if rendered.count(_MARK) != 1:
        raise ValueError(f"the chat template writes an assistant turn's content {rendered.count(_MARK)} time(s), "
                         "not once, so the text between two turns cannot be cut out of it")
    tail = rendered.split(_MARK, 1)[1]
    end_token = _end_of_turn_text(tokenizer)
    if after_end_of_turn and end_token and tail.startswith(end_token):
        tail = tail[len(end_token):]
    return tokenizer(tail, add_special_tokens=False)["input_ids"]


def _end_of_turn_text(tokenizer) -> str | None:
    from grouprl.models.inputs import end_of_turn_id

    return tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))


class MultiTurnRollout:
    """Runs verifier-guided dialogues on an engine; ``generate`` returns them as a RolloutBatch.

    ``last_metrics`` (with ``metric_kinds``) describes the last call: turns per sample,
    stop reasons, verifier failures, tokens and latency, hallucination scores.
    """

    metric_kinds = {"verifier/failures": "sum", "verifier/tokens": "sum"}

    def __init__(self, verifier, processor, config, *, end_of_turn_ids: list[int]) -> None:
        from grouprl.rollout.verifier import has_final_answer

        self.verifier = verifier
        self.processor = processor
        self.config = config
        self.end_of_turn_ids = set(end_of_turn_ids)
        self._has_final_answer = has_final_answer
        self.last_metrics: dict[str, float] = {}
        self._failed_in_a_row = 0  # verifier calls, in request order, within one generate call

    def generate(self, engine, samples: list[Sample], params: SamplingParams, *,
                 validation: bool = False) -> RolloutBatch:
        """``params.n`` dialogues per sample; the verifier sees the reference in training only.

        Each policy turn is sampled with at most ``max_tokens_per_turn`` new tokens
        (``params.max_new_tokens`` when None).
        """
        if self.config.max_tokens_per_turn is not None:
            params = replace(params, max_new_tokens=self.config.max_tokens_per_turn)
        first = engine.generate(samples, params)
        # each call gives the verifier a new chance: one that was down may be back
        self._failed_in_a_row = 0
        dialogues = self._open(first)
        tokenizer = tokenizer_of(self.processor)
        for turn in range(1, self.config.max_turns + 1):
            # the verifier answers every policy turn, the last included (its score counts)
            self._ask_verifier(dialogues, validation)
            for d in dialogues:
                if d.open and turn == self.config.max_turns:
                    d.stop_reason = "max_turns"
            for d in dialogues:
                if not d.open:
                    continue
                message = self._next_user_message(d)
                ids = turn_boundary_ids(self.processor, message, after_end_of_turn=not d.truncated,
                                        chat_template_kwargs=d.sample.chat_template_kwargs)
                limit = self.config.max_dialogue_tokens
                if limit is not None and d.response_tokens + len(ids) >= limit:
                    # max_dialogue_tokens reached (a turn cut at it included): no room for another turn
                    d.stop_reason = "length"
                    continue
                d.segments.append(Segment(torch.tensor(ids, dtype=torch.long), policy=False, text=message))
            going = [d for d in dialogues if d.open]
            if not going:
                break
            seed = None if params.seed is None else params.seed + 1_000_003 * turn
            step = engine.generate([d.sample for d in going], replace(params, n=1, seed=seed),
                                   prompts=[d.context() for d in going])
            for row, d in enumerate(going):
                self._append_turn(d, step, row, tokenizer)
        return self._batch(first, dialogues)

    # ------------------------------------------------------------------ the dialogue

    def _open(self, first: RolloutBatch) -> list[Dialogue]:
        tokenizer = tokenizer_of(self.processor)
        dialogues = []
        for row in range(len(first)):
            ids = first.prompt_ids[row][first.prompt_mask[row].bool()]
            inputs = first.model_inputs[row] if first.model_inputs else {}
            d = Dialogue(first.samples[row], int(first.group_index[row]), EncodedPrompt(ids, dict(inputs)))
            self._append_turn(d, first, row, tokenizer)
            dialogues.append(d)
        return dialogues

    def _append_turn(self, d: Dialogue, batch: RolloutBatch, row: int, tokenizer) -> None:
        length = int(batch.response_mask[row].sum())
        ids = batch.response_ids[row, :length].clone()
        log_probs = None if batch.rollout_log_probs is None else batch.rollout_log_probs[row, :length].clone()
        text = batch.responses[row]
        truncated = bool(batch.truncated[row])
        limit = self.config.max_dialogue_tokens
        if limit is not None:
            room = limit - d.response_tokens
            if len(ids) > room:
                # Cutting a sampled turn at the limit is the turn the engine would have sampled with
                # that limit (tokens come one at a time), so its log-probs stay exact.
                ids = ids[:room]
                log_probs = None if log_probs is None else log_probs[:room]
                text = tokenizer.decode(ids, skip_special_tokens=True)
                truncated = True
        d.segments.append(Segment(ids, policy=True, log_probs=log_probs, text=text))
        d.turns.append(text)
        # A turn cut off at its token limit goes to the verifier like any other (the seed's
        # behaviour); the text after it then starts with the end-of-turn token it never sampled.
        d.truncated = truncated

    def _ask_verifier(self, dialogues: list[Dialogue], validation: bool) -> None:
        from grouprl.rollout.verifier import VerifierRequest

        asking = [d for d in dialogues if d.open]
        if not asking:
            return
        requests = [VerifierRequest(problem=problem_text(d.sample), reference=None if validation else d.sample.answer,
                                    turns=list(d.turns)) for d in asking]
        for d, reply in zip(asking, self.verifier.reply_many(requests)):
            d.replies.append(reply)
            self._failed_in_a_row = self._failed_in_a_row + 1 if reply.failed else 0
            if reply.stop and self._has_final_answer(d.turns[-1]):
                d.stop_reason = "verifier_failure" if reply.failed else "stop"
        limit = self.config.max_consecutive_failures
        if self._failed_in_a_row >= limit:
            ending = [d for d in dialogues if d.open]
            for d in ending:
                d.stop_reason = "verifier_failure"
            if ending:
                logger.warning("verifier %r failed %d call(s) in a row (worker.rollout.verifier."
                               "max_consecutive_failures=%d): taking it as down for this rollout and ending its "
                               "%d open dialogue(s) as verifier failures", self.verifier, self._failed_in_a_row,
                               limit, len(ending))

    def _next_user_message(self, d: Dialogue) -> str:
        reply = d.replies[-1]
        # STOP without a final answer (or a failed verifier, taken as STOP) asks for the answer
        return self.config.continue_message if reply.stop else reply.text

    # ------------------------------------------------------------------ the batch

    def _batch(self, first: RolloutBatch, dialogues: list[Dialogue]) -> RolloutBatch:
        final = self.config.train_scope == "final_turn"
        prompts, responses, masks, log_probs, spans = [], [], [], [], []
        for d in dialogues:
            last = max(i for i, s in enumerate(d.segments) if s.policy)
            spans.append(_spans(d.segments[last:] if final else d.segments))
            head = d.segments[:last] if final else []
            body = d.segments[last:] if final else d.segments
            prompts.append(torch.cat([d.prompt.ids, *[s.ids for s in head]]))
            responses.append(torch.cat([s.ids for s in body]))
            masks.append(torch.cat([torch.full((len(s.ids),), int(s.policy and not self._unaccepted(d, s)))
                                    for s in body]))
            if first.rollout_log_probs is not None:
                log_probs.append(torch.cat([s.log_probs if s.policy and s.log_probs is not None
                                            else torch.zeros(len(s.ids)) for s in body]))
        pad = tokenizer_of(self.processor).pad_token_id
        prompt_ids, prompt_mask = left_pad(prompts, pad)
        response_ids, response_mask = _right_pad(responses, pad)
        policy_mask, _ = _right_pad(masks, 0)
        rollout_log_probs = _right_pad(log_probs, 0)[0].float() if log_probs else None
        batch = RolloutBatch(
            samples=[d.sample for d in dialogues], group_index=first.group_index.clone(),
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
            response_mask=response_mask, policy_mask=policy_mask,
            responses=[d.turns[-1] for d in dialogues],  # what rewards judge: the final turn
            truncated=torch.tensor([d.truncated for d in dialogues]),
            model_inputs=[d.prompt.model_inputs for d in dialogues] if first.model_inputs else [],
            rollout_log_probs=rollout_log_probs,
            extras={
                "verifier_hallucination_score": [d.hallucination_score() for d in dialogues],
                "num_turns": [len(d.turns) for d in dialogues],
                "stop_reason": [d.stop_reason for d in dialogues],
                "dialogue": [_dialogue_record(d) for d in dialogues],
                "spans": spans,
            },
        )
        self.last_metrics = self._metrics(dialogues)
        return batch

    def _unaccepted(self, d: Dialogue, segment: Segment) -> bool:
        """Whether ``turn_credit: mask_fixed`` takes ``segment`` out of the loss: a policy turn before
        the last of a dialogue the verifier stopped (its answer accepted), so only the fix is trained."""
        if self.config.turn_credit != "mask_fixed" or self.config.train_scope != "full_turn":
            return False
        return d.stop_reason == "stop" and segment.policy and segment is not _last_policy_segment(d)

    def _metrics(self, dialogues: list[Dialogue]) -> dict[str, float]:
        n = len(dialogues)
        replies = [r for d in dialogues for r in d.replies]
        metrics = {
            "multiturn/turns_mean": sum(len(d.turns) for d in dialogues) / n,
            # policy turns out of the loss (turn_credit: mask_fixed), per dialogue
            "multiturn/masked_turns": sum(self._unaccepted(d, s) for d in dialogues for s in d.segments) / n,
            "multiturn/hallucination_score": sum(d.hallucination_score() for d in dialogues) / n,
            "verifier/failures": float(sum(r.failed for r in replies)),
            # 1 when max_consecutive_failures ended the dialogues (the verifier taken as down)
            "verifier/down": float(self._failed_in_a_row >= self.config.max_consecutive_failures),
            "verifier/tokens": float(sum(r.tokens or 0 for r in replies)),
            "verifier/latency_s": sum(r.latency_s for r in replies) / len(replies) if replies else 0.0,
        }
        for reason in STOP_REASONS:
            metrics[f"multiturn/stop_{reason}"] = sum(d.stop_reason == reason for d in dialogues) / n
        return metrics


def _last_policy_segment(d: Dialogue) -> Segment:
    return next(s for s in reversed(d.segments) if s.policy)


def _dialogue_record(d: Dialogue) -> list[dict]:
    """The dialogue as messages, for rollouts.jsonl: the policy's turns and what came between them."""
    out = []
    for s in d.segments:
        out.append({"role": "assistant" if s.policy else "user", "text": s.text, "tokens": len(s.ids)})
    return out


def _spans(segments: list[Segment]) -> list[list]:
    """[start, end, kind] of each segment within the trained response (kind: policy or between)."""
    spans, at = [], 0
    for s in segments:
        spans.append([at, at + len(s.ids), "policy" if s.policy else "between"])
        at += len(s.ids)
    return spans


def _right_pad(rows: list[torch.Tensor], value) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return out, mask
