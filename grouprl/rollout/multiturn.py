"""Multi-turn rollouts in token space: the policy, its tools and an environment take turns.

Each sampled response becomes a dialogue. After each policy turn the rollout answers it:
when the dialogue has tools (``worker.rollout.multi_turn.tools`` and the environment's tool
methods) and the turn calls some, their results come back as ``tool`` messages
(:mod:`grouprl.rollout.tools`); otherwise the dialogue's environment answers
(:mod:`grouprl.rollout.environments`: user or tool messages, text and images, done or not,
reward parts). Guided-GRPO's verifier is one such environment
(:class:`grouprl.rollout.verifier.VerifierEnvironment`); an environment with tools alone (TRL's)
ends the dialogue at the first turn without a tool call. A dialogue has at most ``max_turns``
policy turns of at most ``max_tokens_per_turn`` tokens (and, when set, ``max_dialogue_tokens``
response tokens in all); a turn cut off at its token limit is answered like any other and the
dialogue goes on (the Guided-GRPO seed's behaviour).

Failures: an environment call that raises, returns the wrong type or runs past
``step_timeout`` is counted; under ``on_failure: stop`` it ends its dialogue (stop reason the
environment's ``failure_reason``: ``environment_failure``, the verifier's ``verifier_failure``),
under ``fail`` the call raises :class:`~grouprl.rollout.environments.EnvironmentFailure`. After
``max_consecutive_failures`` failed calls in a row the environment is taken as down for the rest
of the call: every open dialogue ends and one warning names it, rather than each dialogue asking a
dead server again, through its retries and timeouts, for every turn up to ``max_turns``. Tool
errors (malformed call, unknown tool, wrong arguments, raised, timed out) never end a dialogue:
the policy reads the error text (counted in ``tools/errors``).

The trajectory lives in token space. The policy's sampled ids are kept exactly as sampled; only
the text between turns is tokenized (the end of the assistant's turn, the messages, the next
assistant header, all rendered by the model's own chat template with the dialogue's tool
schemas: :func:`grouprl.rollout.turn_tokens.between_turns`); and the next turn is generated from
exactly the ids that will be trained on (``EncodedPrompt``). Images returned between turns enter
the context with their placeholder tokens and pixel values, appended to the row's model inputs
in order, so positions come from the model itself over the whole sequence: Qwen-VL's M-RoPE
indices are computed from the full ids and all of their images on every forward, in generation
and in training.

Dialogues of a batch advance turn by turn together: each turn is one engine call for the
dialogues still open, and finished ones drop out.

``train_scope``: ``full_turn`` trains every policy turn (the response is the whole dialogue after
the first prompt; template, tool and environment tokens have attention but no loss);
``final_turn`` trains the last policy turn alone, its prompt the whole dialogue before it.

``turn_credit: mask_fixed`` (with ``full_turn``) takes the policy turns before the last out of the
loss in a dialogue its environment ended with ``stop``: the reward is the final answer's, and the
earlier turns did not earn it (``shared``, the seed's, trains them with it too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from grouprl.data.sample import Sample
from grouprl.models.inputs import left_pad, tokenizer_of
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.engine import EncodedPrompt, SamplingParams
from grouprl.rollout.environments import (Environment, EnvironmentFailure, EnvironmentPool, Step, check_step,
                                          reward_parts_of)
from grouprl.rollout.tools import (Tool, ToolCall, ToolLimits, ToolRunner, parse_tool_calls, parser_for_template,
                                   tool_schema)
from grouprl.rollout.turn_tokens import append_model_inputs, between_turns, rgb_image
from grouprl.rewards.scoring import is_async, start_thread

logger = logging.getLogger(__name__)

STOP_REASONS = ("stop", "max_turns", "length")


@dataclass
class Segment:
    """A stretch of a dialogue's response: a policy turn (sampled) or the text between turns."""

    ids: torch.Tensor  # [L] long
    policy: bool
    log_probs: torch.Tensor | None = None  # [L], the sampler's, for policy turns when asked for
    text: str = ""
    messages: list[dict] = field(default_factory=list)  # between turns: the messages the ids render
    tool_calls: list[dict] = field(default_factory=list)  # a policy turn: the calls parsed from it


@dataclass
class Dialogue:
    sample: Sample
    group: int
    prompt: EncodedPrompt
    environment: Environment | None = None
    environment_name: str = ""
    tools: ToolRunner | None = None
    segments: list[Segment] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)  # the policy's turns, decoded
    pending: list[dict] = field(default_factory=list)  # the messages answering the last turn
    model_inputs: dict = field(default_factory=dict)  # the prompt's, then each returned image's, in order
    images: list = field(default_factory=list)  # images returned within the dialogue, in order
    rewards: dict[str, float] = field(default_factory=dict)  # the environment's reward parts, summed
    errors: list[str] = field(default_factory=list)  # environment errors (stop) and protocol breaches
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
        return EncodedPrompt(ids, dict(self.model_inputs), list(self.images))


# tokens a chat template writes around the messages between two turns (end of turn, role headers); generous
TEMPLATE_TOKENS_PER_TURN = 32


def max_tokens_per_turn(max_response_length: int, config) -> int:
    """The most tokens of one policy turn: ``max_tokens_per_turn``, or ``data.max_response_length`` when None."""
    per_turn = config.max_tokens_per_turn
    return max_response_length if per_turn is None else per_turn


def observation_budget(config) -> int:
    """The most tokens between two policy turns: ``max_observation_tokens`` (multi_turn), or the verifier's
    ``max_tokens`` with the template around it."""
    limit = getattr(config, "max_observation_tokens", None)
    return limit if limit is not None else config.max_tokens + TEMPLATE_TOKENS_PER_TURN


def dialogue_response_budget(max_response_length: int, config) -> int:
    """The most response tokens an engine must hold for one dialogue: ``max_turns`` policy turns of
    at most ``max_tokens_per_turn`` tokens, and at most :func:`observation_budget` tokens between each
    two; with ``max_dialogue_tokens`` set, no more than that limit plus one turn (the last turn is
    sampled with a whole turn's room and cut at the limit). An engine sizes its context with it.
    ``config``: ``worker.rollout.verifier`` or ``worker.rollout.multi_turn``."""
    per_turn = max_tokens_per_turn(max_response_length, config)
    turns = config.max_turns
    budget = turns * per_turn + (turns - 1) * observation_budget(config)
    if config.max_dialogue_tokens is not None:
        budget = min(budget, config.max_dialogue_tokens + per_turn)
    return budget


def run_response_budget(config) -> int:
    """The most response tokens one rollout of the run ``config`` can hold: a dialogue's
    (:func:`dialogue_response_budget`) under ``worker.rollout.verifier`` or ``multi_turn``, else
    ``data.max_response_length``. vLLM sizes its context with it, ``grouprl plan`` its sequences."""
    roll, length = config.worker.rollout, config.data.max_response_length
    if roll.verifier.enable:
        return dialogue_response_budget(length, roll.verifier)
    if roll.multi_turn.enabled:
        return dialogue_response_budget(length, roll.multi_turn)
    return length


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
    """Token ids between two policy turns for one user ``message``: :func:`between_turns`' ids."""
    return between_turns(processor, [{"role": "user", "content": message}], after_end_of_turn=after_end_of_turn,
                         chat_template_kwargs=chat_template_kwargs).ids


def with_observation(sample: Sample, observation: str | list[dict] | None, tools: list[dict]) -> Sample:
    """``sample`` as the dialogue's first prompt: ``observation`` (an environment's ``reset``) appended to
    its last user message as TRL does (text to text; content parts, images included, to parts), and the
    tool schemas given to the chat template (``tools=``)."""
    if observation is None and not tools:
        return sample
    messages, images = list(sample.messages), list(sample.images)
    if observation is not None:
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last is None:
            raise ValueError(f"sample {sample.id}: an environment's reset() text needs a user message to go into")
        content = messages[last]["content"]
        content = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        parts = [{"type": "text", "text": observation}] if isinstance(observation, str) else list(observation)
        for part in parts:
            if part.get("type") == "image":
                # a sample holds image slots; its images list fills them in order
                images.append(rgb_image(part.get("image"), f"sample {sample.id}: the environment's reset() image"))
                content.append({"type": "image"})
            else:
                content.append(part)
        messages[last] = {**messages[last], "content": content}
    kwargs = dict(sample.chat_template_kwargs)
    if tools:
        kwargs["tools"] = tools
    return replace(sample, messages=messages, images=images, chat_template_kwargs=kwargs)


@dataclass(frozen=True)
class MetricKinds:
    """How a call's metrics combine over micro-batches and processes: ``metric_kinds`` (``sum`` for
    counts; the rest are means) and ``metric_weights`` (a mean's weight when it is not the rows)."""

    metric_kinds: dict[str, str]
    metric_weights: dict[str, float]


class MultiTurnRollout:
    """Runs dialogues on an engine; ``generate`` returns them as a RolloutBatch.

    ``environments``: an :class:`~grouprl.rollout.environments.EnvironmentPool` (each sample's
    environment by name), a :class:`~grouprl.rollout.verifier.Verifier` (Guided-GRPO: the
    ``verifier`` environment around it), or None (tools alone). ``config``: the dialogue's
    limits (``worker.rollout.multi_turn`` or ``worker.rollout.verifier``). ``tools``: the tools
    every dialogue has besides its environment's; ``tool_parser``: the tool-call format (None:
    from the chat template).

    ``last_metrics`` (with ``metric_kinds`` and, for means not weighted by rows, ``metric_weights``)
    describes the last call: turns per dialogue, stop reasons, tool calls and errors, environment
    failures and rewards, and what the environment adds (the verifier's tokens, latency,
    hallucination scores).
    """

    def __init__(self, environments, processor, config, *, end_of_turn_ids: list[int],
                 tools: Sequence[Tool] = (), tool_parser: str | None = None,
                 tool_limits: ToolLimits = ToolLimits(), environment_field: str | None = None) -> None:
        from grouprl.rollout.verifier import Verifier, VerifierEnvironment

        self.processor = processor
        self.config = config
        self.end_of_turn_ids = set(end_of_turn_ids)
        self.tools = list(tools)
        self.tool_limits = tool_limits
        self.environment_field = environment_field
        self._validation = False
        if isinstance(environments, Verifier):
            # the verifier sees the reference in training only: the rollout says which it is
            factory = functools.partial(VerifierEnvironment, environments, lambda: self._validation)
            environments = EnvironmentPool({"verifier": factory})
        elif environments is None:
            environments = EnvironmentPool({"tools": Environment})
        self.pool = environments
        self._tool_parser = tool_parser
        self._parser: str | None = None  # resolved on first use: a dialogue without tools needs none
        self.last_metrics: dict[str, float] = {}
        self.metric_kinds: dict[str, str] = {}
        self.metric_weights: dict[str, float] = {}  # a mean's weight when it is not the call's rows
        self._failed_in_a_row = 0  # environment calls, in request order, within one generate call
        self._schemas: dict[tuple, dict] = {}

    def generate(self, engine, samples: list[Sample], params: SamplingParams, *,
                 validation: bool = False) -> RolloutBatch:
        """``params.n`` dialogues per sample; in ``validation`` the verifier sees no reference.

        Each policy turn is sampled with at most ``max_tokens_per_turn`` new tokens
        (``params.max_new_tokens`` when None).
        """
        if self.config.max_tokens_per_turn is not None:
            params = replace(params, max_new_tokens=self.config.max_tokens_per_turn)
        self._validation = validation
        # each call gives the environment a new chance: one that was down may be back
        self._failed_in_a_row = 0
        dialogues, first = self._open(engine, samples, params)
        tokenizer = tokenizer_of(self.processor)
        for turn in range(1, self.config.max_turns + 1):
            # every policy turn is answered, the last included (a verifier's score, an environment's reward)
            self._answer(dialogues, last_turn=turn == self.config.max_turns)
            for d in dialogues:
                if d.open and turn == self.config.max_turns:
                    d.stop_reason = "max_turns"
            for d in dialogues:
                if d.open:
                    self._append_between(d)
            going = [d for d in dialogues if d.open]
            if not going:
                break
            seed = None if params.seed is None else params.seed + 1_000_003 * turn
            step = engine.generate([d.sample for d in going], replace(params, n=1, seed=seed),
                                   prompts=[d.context() for d in going])
            for row, d in enumerate(going):
                self._append_turn(d, step, row, tokenizer)
        return self._batch(first, dialogues)

    # ------------------------------------------------------------------ opening

    def _names(self, samples: list[Sample]) -> list[str]:
        names = list(self.pool.factories)
        if len(names) == 1:
            return [names[0]] * len(samples)
        field_name = self.environment_field or "environment"
        out = []
        for s in samples:
            name = s.columns.get(field_name)
            if name not in self.pool.factories:
                raise EnvironmentFailure(f"sample {s.id}: field {field_name!r} is {name!r}, not one of the "
                                         f"environments {sorted(self.pool.factories)} "
                                         "(worker.rollout.multi_turn.environments)")
            out.append(name)
        return out

    def _open(self, engine, samples: list[Sample], params: SamplingParams) -> tuple[list[Dialogue], RolloutBatch]:
        n = params.n
        names = [name for name in self._names(samples) for _ in range(n)]
        environments = self.pool.take(names)
        observations, schemas = [], []
        for row, env in enumerate(environments):
            sample = samples[row // n]
            observations.append(self._call(env, "reset", (sample,), f"{env!r}.reset() on sample {sample.id}"))
            schemas.append([self._schema(fn) for fn in self._tool_functions(env)])
        firsts = [with_observation(samples[row // n], obs, schema)
                  for row, (obs, schema) in enumerate(zip(observations, schemas))]
        # one engine call with n per sample when a sample's dialogues open alike, else one row each
        alike = all(firsts[g * n + k] is firsts[g * n] or _same_prompt(firsts[g * n + k], firsts[g * n])
                    for g in range(len(samples)) for k in range(n))
        if alike:
            first = engine.generate([firsts[g * n] for g in range(len(samples))], params)
        else:
            first = engine.generate(firsts, replace(params, n=1))
            first.group_index = torch.arange(len(firsts)) // n
        tokenizer = tokenizer_of(self.processor)
        dialogues = []
        for row in range(len(first)):
            ids = first.prompt_ids[row][first.prompt_mask[row].bool()]
            inputs = dict(first.model_inputs[row]) if first.model_inputs else {}
            env = environments[row]
            functions = self._tool_functions(env)
            runner = ToolRunner([Tool(self._schema(fn)["function"]["name"], fn, self._schema(fn))
                                 for fn in functions], self.tool_limits) if functions else None
            d = Dialogue(first.samples[row], int(first.group_index[row]), EncodedPrompt(ids, inputs),
                         environment=env, environment_name=names[row], tools=runner, model_inputs=dict(inputs))
            self._append_turn(d, first, row, tokenizer)
            dialogues.append(d)
        return dialogues, first

    def _tool_functions(self, env: Environment) -> list[Callable[..., Any]]:
        return [t.fn for t in self.tools] + list(env.tools())

    def _schema(self, fn: Callable[..., Any]) -> dict:
        """transformers' schema of a tool; an environment method's is read once per class."""
        key = (getattr(type(getattr(fn, "__self__", None)), "__qualname__", None), getattr(fn, "__name__", id(fn)))
        for tool in self.tools:
            if tool.fn is fn:
                return tool.schema
        if key not in self._schemas:
            self._schemas[key] = tool_schema(fn)
        return self._schemas[key]

    # ------------------------------------------------------------------ answering a turn

    def metrics_snapshot(self) -> tuple[MetricKinds, dict[str, float]]:
        """The last call's metrics with how they combine, as a rollout transform reports them: taken now,
        since the next call (the next micro-batch) replaces them."""
        return MetricKinds(dict(self.metric_kinds), dict(self.metric_weights)), dict(self.last_metrics)

    @property
    def tool_parser(self) -> str:
        """The tool-call format's parser: the one named, else the chat template's (an error naming the
        template's want when it shows none)."""
        if self._parser is None:
            renderer = self.processor if getattr(self.processor, "chat_template", None) else \
                tokenizer_of(self.processor)
            self._parser = parser_for_template(getattr(renderer, "chat_template", None), self._tool_parser)
        return self._parser

    def _answer(self, dialogues: list[Dialogue], *, last_turn: bool) -> None:
        """Tool results for the open dialogues whose last turn called tools, the environment's step for the
        others. On the last turn a turn with tool calls is not answered (no turn would read the results):
        its dialogue ends at ``max_turns``."""
        stepping = []
        for d in dialogues:
            if not d.open:
                continue
            calls = self._tool_calls(d)
            if calls and last_turn:
                continue
            if calls:
                results = d.tools.run_turn(calls)
                d.pending = [r.message for r in results]
            else:
                stepping.append(d)
        if stepping:
            self._step(stepping)

    def _tool_calls(self, d: Dialogue) -> list:
        if d.tools is None:
            return []
        parsed = parse_tool_calls(d.turns[-1], self.tool_parser)
        calls = list(parsed.calls)
        segment = _last_policy_segment(d)
        segment.tool_calls = [c.as_message_part() if isinstance(c, ToolCall) else {"error": c.message, "text": c.text}
                              for c in calls]
        return calls

    def _step(self, dialogues: list[Dialogue]) -> None:
        """Each dialogue's environment answers its last turn: a class's ``step_many`` for its dialogues
        together (the verifier's batched backend), else each ``step`` in its own thread, concurrently."""
        by_class: dict[type, list[Dialogue]] = {}
        for d in dialogues:
            by_class.setdefault(type(d.environment), []).append(d)
        steps: dict[int, Step] = {}
        for cls, group in by_class.items():
            step_many = getattr(cls, "step_many", None)
            if step_many is not None:
                for d, step in zip(group, step_many([d.environment for d in group], [d.turns[-1] for d in group])):
                    steps[id(d)] = step
            else:
                futures = [self._start(d.environment, "step", (d.turns[-1],)) for d in group]
                for d, future in zip(group, futures):
                    steps[id(d)] = self._result(d.environment, future, f"{d.environment!r}.step() on sample "
                                                                       f"{d.sample.id}")
        for d in dialogues:  # in request order, for the count of failures in a row
            self._take_step(d, steps[id(d)])
        limit = self.config.max_consecutive_failures
        if self._failed_in_a_row >= limit:
            ending = [d for d in dialogues if d.open]
            for d in ending:
                d.stop_reason = d.environment.failure_reason
            if ending:
                logger.warning("environment %r failed %d call(s) in a row (max_consecutive_failures=%d): taking it "
                               "as down for this rollout and ending its %d open dialogue(s) as failures",
                               dialogues[0].environment, self._failed_in_a_row, limit, len(ending))

    def _take_step(self, d: Dialogue, step: Step) -> None:
        env = d.environment
        try:
            step = check_step(step, env)
            for part, value in reward_parts_of(step.reward, env, where=f"{env!r}.step()").items():
                d.rewards[part] = d.rewards.get(part, 0.0) + value
            if not step.done and not step.messages and not step.failed:
                raise EnvironmentFailure(f"{env!r}.step() neither ended the dialogue nor gave a message")
        except EnvironmentFailure as exc:
            step = self._failure(env, exc)
        self._failed_in_a_row = self._failed_in_a_row + 1 if step.failed else 0
        if step.failed and step.error:
            d.errors.append(step.error)
        if step.done:
            d.stop_reason = env.failure_reason if step.failed else "stop"
        else:
            d.pending = list(step.messages)

    def _failure(self, env: Environment, exc: BaseException) -> Step:
        """An environment call that failed: raised under ``on_failure: fail``, else a failed, final step."""
        if getattr(self.config, "on_failure", "stop") == "fail":
            raise exc if isinstance(exc, EnvironmentFailure) else EnvironmentFailure(str(exc))
        logger.warning("%s", exc)
        return Step(done=True, failed=True, error=str(exc))

    def _start(self, env: Environment, method: str, args: tuple) -> concurrent.futures.Future:
        fn = getattr(env, method)
        if is_async(fn):
            coroutine_fn = fn
            fn = lambda *a: asyncio.run(coroutine_fn(*a))  # noqa: E731 - its own loop in its own thread
        return start_thread(fn, list(args), {}, f"environment-{method}")

    def _outcome(self, future: concurrent.futures.Future, label: str):
        """The call's value within ``step_timeout``; else an :class:`EnvironmentFailure` naming ``label``."""
        timeout = getattr(self.config, "step_timeout", None)
        # wait(), not result(timeout): a TimeoutError the environment raises itself is its own error
        concurrent.futures.wait([future], timeout=timeout)
        if not future.done():
            raise EnvironmentFailure(f"{label}: no answer within {timeout:g} s "
                                     "(worker.rollout.multi_turn.step_timeout); abandoned")
        try:
            return future.result()
        except EnvironmentFailure:
            raise
        except Exception as exc:  # the environment's own error: named, counted, never a silent stop
            raise EnvironmentFailure(f"{label} raised {type(exc).__name__}: {exc}") from exc

    def _result(self, env: Environment, future: concurrent.futures.Future, label: str) -> Step:
        """A step's outcome; a failed one under the failure policy (:meth:`_failure`)."""
        try:
            return self._outcome(future, label)
        except EnvironmentFailure as exc:
            return self._failure(env, exc)

    def _call(self, env: Environment, method: str, args: tuple, label: str):
        """``env.method(*args)`` within ``step_timeout``; a failure is an :class:`EnvironmentFailure` naming it."""
        return self._outcome(self._start(env, method, args), label)

    # ------------------------------------------------------------------ the dialogue in token space

    def _append_between(self, d: Dialogue) -> None:
        kwargs = d.sample.chat_template_kwargs
        try:
            between = between_turns(self.processor, d.pending, after_end_of_turn=not d.truncated,
                                    chat_template_kwargs=kwargs, images_before=len(d.sample.images) + len(d.images))
        except ValueError as exc:  # e.g. an image for a text-only policy: the environment's error, counted
            d.errors.append(f"{d.environment!r}: {exc}")
            d.stop_reason = d.environment.failure_reason
            return
        limit = self.config.max_dialogue_tokens
        over_turn = getattr(self.config, "max_observation_tokens", None)
        if (limit is not None and d.response_tokens + len(between.ids) >= limit) or \
                (over_turn is not None and len(between.ids) > over_turn):
            # no room for another turn (max_dialogue_tokens reached, a turn cut at it included), or the
            # messages are longer than one observation may be
            d.stop_reason = "length"
            return
        if between.model_inputs:
            d.model_inputs = append_model_inputs(d.model_inputs, between.model_inputs)
            d.images.extend(between.images)
        text = "\n".join(_message_text(m) for m in d.pending)
        d.segments.append(Segment(torch.tensor(between.ids, dtype=torch.long), policy=False, text=text,
                                  messages=list(d.pending)))
        d.pending = []

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
        # A turn cut off at its token limit is answered like any other (the seed's behaviour); the
        # text after it then starts with the end-of-turn token it never sampled.
        d.truncated = truncated

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
        extras: dict[str, list] = {
            "num_turns": [len(d.turns) for d in dialogues],
            "stop_reason": [d.stop_reason for d in dialogues],
            "dialogue": [_dialogue_record(d) for d in dialogues],
            "spans": spans,
        }
        if any(d.tools is not None for d in dialogues):
            extras["tool_calls"] = [0 if d.tools is None else d.tools.attempted for d in dialogues]
        self._final_rewards(dialogues)
        if self.pool.reward_parts():
            extras["environment_rewards"] = [dict(d.rewards) for d in dialogues]
        for row, d in enumerate(dialogues):
            for key, value in _columns(d.environment).items():
                extras.setdefault(key, [None] * len(dialogues))[row] = value
        batch = RolloutBatch(
            samples=[d.sample for d in dialogues], group_index=first.group_index.clone(),
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
            response_mask=response_mask, policy_mask=policy_mask,
            responses=[d.turns[-1] for d in dialogues],  # what rewards judge: the final turn
            truncated=torch.tensor([d.truncated for d in dialogues]),
            model_inputs=[d.model_inputs for d in dialogues] if first.model_inputs or
            any(d.model_inputs for d in dialogues) else [],
            rollout_log_probs=rollout_log_probs,
            extras=extras,
        )
        self.last_metrics, self.metric_kinds = self._metrics(dialogues)
        return batch

    def _final_rewards(self, dialogues: list[Dialogue]) -> None:
        """``get_reward()`` of each dialogue's environment that has one, added to its parts."""
        for d in dialogues:
            env = d.environment
            if not callable(getattr(env, "get_reward", None)):
                continue
            where = f"{env!r}.get_reward() on sample {d.sample.id}"
            try:
                value = self._call(env, "get_reward", (), where)
                for part, v in reward_parts_of(value, env, where=where).items():
                    d.rewards[part] = d.rewards.get(part, 0.0) + v
            except EnvironmentFailure as exc:
                # its parts stay unscored for this row (None for the reward set, never 0), and it is counted
                if getattr(self.config, "on_failure", "stop") == "fail":
                    raise
                logger.warning("%s", exc)
                d.errors.append(str(exc))

    def _unaccepted(self, d: Dialogue, segment: Segment) -> bool:
        """Whether ``turn_credit: mask_fixed`` takes ``segment`` out of the loss: a policy turn before
        the last of a dialogue its environment stopped (its answer accepted), so only the fix is trained."""
        if self.config.turn_credit != "mask_fixed" or self.config.train_scope != "full_turn":
            return False
        return d.stop_reason == "stop" and segment.policy and segment is not _last_policy_segment(d)

    def _metrics(self, dialogues: list[Dialogue]) -> tuple[dict[str, float], dict[str, str]]:
        """The call's metrics and their kinds. Every process must log the same keys (the step's metrics are
        reduced key by key), so the keys come from the run's environments and tools, not from the
        dialogues this call happened to have: a per-environment mean with no dialogue here has weight 0
        (:attr:`metric_weights`)."""
        n = len(dialogues)
        kinds: dict[str, str] = {"environment/errors": "sum"}
        self.metric_weights = {}
        metrics = {
            "multiturn/turns": sum(len(d.turns) for d in dialogues) / n,
            # policy turns out of the loss (turn_credit: mask_fixed), per dialogue
            "multiturn/masked_turns": sum(self._unaccepted(d, s) for d in dialogues for s in d.segments) / n,
            "environment/errors": float(sum(len(d.errors) for d in dialogues)),
            # 1 when max_consecutive_failures ended the dialogues (the environment taken as down)
            "environment/down": float(self._failed_in_a_row >= self.config.max_consecutive_failures),
        }
        probes = dict(zip(self.pool.factories, self.pool.take(list(self.pool.factories))))
        reasons = list(STOP_REASONS) + sorted({env.failure_reason for env in probes.values()})
        for reason in reasons:
            metrics[f"multiturn/stop_reason/{reason}"] = sum(d.stop_reason == reason for d in dialogues) / n
        tool_names = [t.name for t in self.tools] + sorted({self._schema(fn)["function"]["name"]
                                                             for env in probes.values() for fn in env.tools()})
        if tool_names:
            runners = [d.tools for d in dialogues if d.tools is not None]
            per_tool: Counter[str] = Counter()
            for r in runners:
                per_tool.update(r.per_tool)
            metrics["tools/calls"] = float(sum(r.attempted for r in runners))
            metrics["tools/errors"] = float(sum(r.errors for r in runners))
            metrics["tools/refused"] = float(sum(r.refused for r in runners))
            for name in tool_names:
                metrics[f"tools/{name}/calls"] = float(per_tool[name])
            kinds.update({k: "sum" for k in metrics if k.startswith("tools/")})
        for part in self.pool.reward_parts():
            for name in probes:
                values = [d.rewards[part] for d in dialogues if d.environment_name == name and part in d.rewards]
                key = f"environment/{name}/{part}"
                metrics[key] = sum(values) / len(values) if values else 0.0
                self.metric_weights[key] = len(values)
        for cls in dict.fromkeys(type(env) for env in probes.values()):
            hook = getattr(cls, "metrics", None)
            if hook is not None:  # called with this call's dialogues of the class, possibly none
                extra, extra_kinds = hook([d.environment for d in dialogues if type(d.environment) is cls])
                metrics.update(extra)
                kinds.update(extra_kinds)
        return metrics, kinds


def _same_prompt(a: Sample, b: Sample) -> bool:
    return a.messages == b.messages and a.chat_template_kwargs == b.chat_template_kwargs and \
        len(a.images) == len(b.images) and all(x is y for x, y in zip(a.images, b.images))


def _columns(env: Environment) -> dict:
    hook = getattr(env, "columns", None)
    return dict(hook()) if callable(hook) else {}


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if p.get("type") == "text" else f"[{p.get('type')}]" for p in content or [])


def _last_policy_segment(d: Dialogue) -> Segment:
    return next(s for s in reversed(d.segments) if s.policy)


def _dialogue_record(d: Dialogue) -> list[dict]:
    """The dialogue as messages, for rollouts.jsonl and the report: the policy's turns (with the tool
    calls parsed from them) and the messages between them (a tool's named). Messages answering a turn's
    tool calls also list each result (``results``: name, text, images); messages from the environment
    name it (``environment``)."""
    out = []
    answered_calls = False
    for s in d.segments:
        if s.policy:
            entry = {"role": "assistant", "text": s.text, "tokens": len(s.ids)}
            if s.tool_calls:
                entry["tool_calls"] = s.tool_calls
            answered_calls = bool(s.tool_calls)  # a turn with calls is answered by their results (_answer)
            out.append(entry)
            continue
        roles = {m.get("role") for m in s.messages} or {"user"}
        entry = {"role": roles.pop() if len(roles) == 1 else "user", "text": s.text, "tokens": len(s.ids)}
        names = [m["name"] for m in s.messages if m.get("role") == "tool" and m.get("name")]
        if names:
            entry["tools"] = names
        images = sum(_image_count(m) for m in s.messages)
        if images:
            entry["images"] = images
        if answered_calls:
            entry["results"] = [{"name": m.get("name", ""), "text": _message_text(m),
                                 **({"images": _image_count(m)} if _image_count(m) else {})} for m in s.messages]
        else:
            entry["environment"] = d.environment_name
        out.append(entry)
    return out


def _image_count(message: dict) -> int:
    content = message.get("content")
    return sum(1 for p in content if p.get("type") == "image") if isinstance(content, list) else 0


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


# ---------------------------------------------------------------------------- from the config


@dataclass
class DialogueParts:
    """What ``worker.rollout.multi_turn`` names, loaded: the environments (None: tools alone), the
    tools every dialogue has, and the reward parts the environments declare."""

    pool: EnvironmentPool | None
    tools: list[Tool]
    reward_parts: list[str]
    environment_tools: list[str] = field(default_factory=list)  # the environments' tool methods, by name


def dialogue_parts(multi_turn) -> DialogueParts:
    """Load the environments and tools ``multi_turn`` (``worker.rollout.multi_turn``) names, and read one
    instance of each environment: its tool methods must have schemas, its tool names must not clash with
    the run's tools. Every problem is a ConfigError naming the key."""
    from grouprl.config import ConfigError
    from grouprl.rollout.environments import EnvironmentLoadError, load_environment
    from grouprl.rollout.tools import ToolLoadError, load_tools

    key = "worker.rollout.multi_turn"
    try:
        tools = load_tools(multi_turn.tools)
    except ToolLoadError as exc:
        raise ConfigError(f"config key '{key}.tools': {exc}") from None
    references = dict(multi_turn.environments)
    if multi_turn.environment:
        references = {_environment_label(multi_turn.environment): multi_turn.environment}
    factories = {}
    for name, reference in references.items():
        where = f"{key}.environments.{name}" if multi_turn.environments else f"{key}.environment"
        try:
            factories[name] = load_environment(reference)
        except EnvironmentLoadError as exc:
            raise ConfigError(f"config key '{where}': {exc}") from None
    if not factories:
        return DialogueParts(None, tools, [])
    pool = EnvironmentPool(factories, field_name=multi_turn.environment_field if multi_turn.environments else None)
    own = {t.name for t in tools}
    environment_tools: list[str] = []
    for name in factories:
        where = f"{key}.environments.{name}" if multi_turn.environments else f"{key}.environment"
        try:
            env = pool.take([name])[0]
            methods = [tool_schema(fn)["function"]["name"] for fn in env.tools()]
        except (EnvironmentLoadError, ToolLoadError) as exc:
            raise ConfigError(f"config key '{where}': {exc}") from None
        except Exception as exc:  # the environment's constructor failed
            raise ConfigError(f"config key '{where}': making the environment {name!r} raised "
                              f"{type(exc).__name__}: {exc}") from None
        clash = sorted(own & set(methods))
        if clash:
            raise ConfigError(f"config key '{where}': the environment's tool(s) {', '.join(clash)} have the name of "
                              f"a tool in '{key}.tools'; the policy calls tools by name")
        environment_tools += [m for m in methods if m not in environment_tools]
    parts = pool.reward_parts()
    unknown = sorted(set(multi_turn.reward_weights) - set(parts))
    if unknown:
        raise ConfigError(f"config key '{key}.reward_weights' names {', '.join(unknown)}, not a reward part of the "
                          f"environments (their parts: {', '.join(parts) or 'none'})")
    return DialogueParts(pool, tools, parts, environment_tools)


def _environment_label(reference: str) -> str:
    """The name an environment's metrics go under: its registered name, or the class of a reference."""
    return reference.rpartition(":")[2] or reference
