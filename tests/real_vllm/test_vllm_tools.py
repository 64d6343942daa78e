"""Tool dialogues on the real vLLM: the policy calls a tool, the tool runs, vLLM continues from token ids.

``MultiTurnRollout`` with tools on the vllm engine: the first turn is sampled by vLLM from the
sample's prompt, the tool call in it is parsed and run, its result goes between the turns through
the chat template (Qwen2.5's: ``<tool_response>`` blocks), and the second turn is sampled by vLLM
from the dialogue's token ids (``EncodedPrompt``). What must hold: the trainer's log-probs of every
policy turn, scored on the assembled dialogue, are vLLM's; only policy tokens are in the loss; the
context vLLM continued from is exactly the ids the trainer scores.

A random tiny model never writes a tool call, and a call put in the prompt (a prefilled assistant
turn) would be prompt tokens, not sampled ones: nothing about the policy's own call would be
checked. So the model is made to write one, honestly: ``tool_calling_model`` sets its weights so
that, greedily, it writes ``<tool_call>{"name":"square","arguments":{"x":7}}</tool_call><|im_end|>``
after an assistant header. vLLM samples those tokens from the model like any others, with their
log-probs (about -0.6 each, not saturated, and different in the second turn's longer context).

The second test gives vLLM dialogue contexts holding 0, 1 and 2 images returned by a tool (a tiny
Qwen2.5-VL): vLLM gets the sample's image and the returned ones and expands them itself; its
prompt must be the trainer's token for token and its log-probs the trainer's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from grouprl.config import MultiTurnConfig
from grouprl.data.sample import Sample
from grouprl.models.inputs import encode_prompts, end_of_turn_id, tokenizer_of
from grouprl.models.loading import load_model_and_processor
from grouprl.rollout.engine import EncodedPrompt, SamplingParams
from grouprl.rollout.hf_engine import HFGenerationEngine
from grouprl.rollout.logprobs import compute_log_probs
from grouprl.rollout.multiturn import MultiTurnRollout, dialogue_response_budget
from grouprl.rollout.tools import load_tools
from grouprl.rollout.turn_tokens import append_model_inputs, between_turns

CALL = '{"name":"square","arguments":{"x":7}}'
TOOL_CALL = f"<tool_call>{CALL}</tool_call><|im_end|>"
RESULT = "\n<|im_start|>user\n<tool_response>\n49\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
PROMPTS = ["Square 7 with the tool.", "What is 7 squared?"]
# what the tokenizer learns: the call's JSON pieces become single tokens, each once in the call
CORPUS = [*PROMPTS, CALL, "<tool_response>\n49\n</tool_response>"] * 8
TINY = dict(hidden_size=128, heads=4, kv_heads=2)  # tests/real_vllm/conftest.py's: head size 32
QWEN25_TEMPLATE = Path(__file__).parents[1] / "core" / "chat_templates" / "Qwen2.5-Instruct.jinja"
MAX_TOKENS_PER_TURN = 20


def tool_calling_model(src: Path, dst: Path, damping: float = 0.5) -> Path:
    """A copy of the tiny Qwen2 at ``src`` that, greedily, answers an assistant header with TOOL_CALL.

    The tokenizer gets Qwen2.5's ``<tool_call>`` / ``</tool_call>`` added tokens and chat template. The
    call's tokens after the header's ``\\n`` form a chain t0 -> t1 -> ... -> ``<|im_end|>`` of distinct
    tokens; each t_k gets an embedding along its own unit vector u_k (orthonormal, at the embeddings'
    usual scale) and the untied output layer's row of t_{k+1} gets 0.6 * u_k, so the final hidden
    state of t_k (its embedding plus what the blocks add) scores t_{k+1} about 7 nats above a random
    row. The blocks' output projections are scaled by ``damping`` so their share, which depends on
    the whole context, shifts the log-probs by a few hundredths without changing the argmax: a
    bigram in the argmax, a transformer in the numbers.
    """
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(src)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = QWEN25_TEMPLATE.read_text(encoding="utf-8")
    chain = tokenizer("\n" + TOOL_CALL, add_special_tokens=False)["input_ids"]
    assert len(set(chain)) == len(chain), f"the call's tokens repeat: {tokenizer.convert_ids_to_tokens(chain)}"
    tied = Qwen2ForCausalLM.from_pretrained(src)
    assert len(tokenizer) <= tied.config.vocab_size
    config = tied.config
    config.tie_word_embeddings = False  # an output row per successor, apart from the embeddings
    model = Qwen2ForCausalLM(config)
    state = tied.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    model.load_state_dict(state)
    hidden = config.hidden_size
    directions, _ = torch.linalg.qr(torch.randn(hidden, len(chain), generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(damping)
            layer.mlp.down_proj.weight.mul_(damping)
        for k, (token, successor) in enumerate(zip(chain[:-1], chain[1:])):
            model.model.embed_tokens.weight[token] = directions[:, k] * 0.02 * math.sqrt(hidden)
            model.lm_head.weight[successor] += 0.6 * directions[:, k]
    model.generation_config = tied.generation_config
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def tool_lm(tiny_text_lm, tmp_path_factory) -> Path:
    return tool_calling_model(tiny_text_lm(CORPUS, seed=5, **TINY), tmp_path_factory.mktemp("tool_lm") / "model")


def start_engine(model, processor, path, device, *, max_response_length: int, **options):
    from grouprl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model, processor, model_path=str(path), max_prompt_length=1024,
                      max_response_length=max_response_length, dtype=device.dtype, enforce_eager=device.enforce_eager,
                      gpu_memory_utilization=0.1, max_num_batched_tokens=2048, enable_sleep_mode=False, **options)


class Spy:
    """Passes every generate call to the engine and keeps its prompts (None: from the samples)."""

    def __init__(self, engine):
        self.engine, self.prompts = engine, []

    def generate(self, samples, params, *, prompts=None):
        self.prompts.append(prompts)
        return self.engine.generate(samples, params, prompts=prompts)


def assert_same_log_probs(sampled, trained, mask, device, what: str) -> None:
    mask = mask.bool()
    gap = (sampled.float() - trained.float()).abs()[mask]
    assert bool(mask.any()), f"{what}: no token to compare"
    assert float(gap.max()) <= device.log_prob_atol and float(gap.mean()) <= device.mean_atol, (
        f"{what}: vLLM's log-probs differ from the trainer's by up to {float(gap.max()):.3g} "
        f"(mean {float(gap.mean()):.3g})")


def test_tool_dialogue_on_vllm_runs_the_tool_and_continues_from_the_exact_context(tool_lm, device):
    model, tokenizer, _ = load_model_and_processor(tool_lm, dtype=device.torch_dtype)
    model = model.to(device.name).eval()
    ran: list[int] = []

    def square(x: int) -> int:
        """Square a number.

        Args:
            x: The number to square.
        """
        ran.append(x)
        return x * x

    config = MultiTurnConfig(max_turns=2, max_tokens_per_turn=MAX_TOKENS_PER_TURN)  # the dialogue's limits
    dialogues = MultiTurnRollout(None, tokenizer, config, end_of_turn_ids=[end_of_turn_id(tokenizer)],
                                 tools=load_tools([square]))
    samples = [Sample(messages=[{"role": "user", "content": text}], index=i) for i, text in enumerate(PROMPTS)]
    params = SamplingParams(n=1, temperature=0.0, do_sample=False, max_new_tokens=MAX_TOKENS_PER_TURN,
                            return_log_probs=True)
    engine = start_engine(model, tokenizer, tool_lm, device,
                          max_response_length=dialogue_response_budget(MAX_TOKENS_PER_TURN, config))
    try:
        spy = Spy(engine)
        batch = dialogues.generate(spy, samples, params)
    finally:
        engine.close()

    # the policy called the tool in its first turn, the tool ran once per dialogue, its result came back
    assert dialogues.tool_parser == "hermes"  # picked from the Qwen2.5 template
    assert ran == [7, 7]
    assert dialogues.last_metrics["tools/calls"] == 2 and dialogues.last_metrics["tools/errors"] == 0
    assert batch.extras["num_turns"] == [2, 2] and batch.extras["stop_reason"] == ["max_turns"] * 2
    for row, record in enumerate(batch.extras["dialogue"]):
        call = {"type": "function", "function": {"name": "square", "arguments": {"x": 7}}}
        assert record[0]["role"] == "assistant" and record[0]["tool_calls"] == [call], record
        assert record[1]["role"] == "tool" and record[1]["text"] == "49" and record[1]["tools"] == ["square"]

    # token space: policy turns as vLLM sampled them, the tool's result as the template writes it
    decode = tokenizer_of(tokenizer).decode
    for row, spans in enumerate(batch.extras["spans"]):
        assert [kind for _, _, kind in spans] == ["policy", "between", "policy"]
        texts = [decode(batch.response_ids[row, start:end]) for start, end, _ in spans]
        assert texts == [TOOL_CALL, RESULT, TOOL_CALL], texts
        # only policy tokens are in the loss
        expected = torch.zeros_like(batch.policy_mask[row])
        for start, end, kind in spans:
            expected[start:end] = int(kind == "policy")
        assert torch.equal(batch.policy_mask[row], expected)

    # the second turn was generated by vLLM from exactly the ids the trainer scores
    assert len(spy.prompts) == 2 and spy.prompts[0] is None
    for row, prompt in enumerate(spy.prompts[1]):
        start = batch.extras["spans"][row][2][0]
        context = torch.cat([batch.prompt_ids[row][batch.prompt_mask[row].bool()], batch.response_ids[row][:start]])
        assert torch.equal(prompt.ids.cpu(), context.cpu()) and prompt.images == [] and not prompt.model_inputs

    # vLLM's log-probs of both policy turns are the trainer's, on the assembled dialogue
    with torch.no_grad():
        trained, _ = compute_log_probs(model, batch, micro_batch_size=2)
    assert_same_log_probs(batch.rollout_log_probs.cpu(), trained.cpu(), batch.policy_mask, device, "tool dialogue")
    between = batch.response_mask.bool() & ~batch.policy_mask.bool()
    assert bool(between.any()) and bool((batch.rollout_log_probs[between] == 0).all())
    # not a vacuous match: the tokens are not certain, and the same tokens weigh otherwise in the longer context
    for row, spans in enumerate(batch.extras["spans"]):
        (a, b, _), _, (c, d, _) = spans
        first, second = batch.rollout_log_probs[row, a:b], batch.rollout_log_probs[row, c:d]
        assert float(first.max()) < -0.1
        assert float((first - second).abs().max()) > 10 * device.log_prob_atol

    if device.name == "cpu":  # fp32: the hf engine runs the very same dialogues
        hf_dialogues = MultiTurnRollout(None, tokenizer, config, end_of_turn_ids=[end_of_turn_id(tokenizer)],
                                        tools=load_tools([square]))
        hf = hf_dialogues.generate(HFGenerationEngine(model, tokenizer), samples, params)
        assert torch.equal(hf.response_ids, batch.response_ids) and torch.equal(hf.policy_mask, batch.policy_mask)


# ---------------------------------------------------------------------------- images returned by a tool


def picture(colour, size=(112, 112)) -> Image.Image:
    return Image.new("RGB", size, colour)


def dialogue_context(processor, sample: Sample, returned: int) -> EncodedPrompt:
    """A second turn's context: ``sample``'s prompt, a turn, a tool message returning ``returned`` pictures."""
    ids, mask, inputs = encode_prompts(processor, [sample])
    tokenizer = tokenizer_of(processor)
    turn = tokenizer("Zoom in.", add_special_tokens=False)["input_ids"] + [end_of_turn_id(processor)]
    pictures = [picture(c, (56 + 28 * k, 84)) for k, c in enumerate([(30, 200, 30), (30, 30, 200)][:returned])]
    message = {"role": "tool", "name": "zoom",
               "content": [*({"type": "image", "image": p} for p in pictures), {"type": "text", "text": "zoomed"}]}
    between = between_turns(processor, [message], after_end_of_turn=True, images_before=len(sample.images))
    context = torch.cat([ids[0][mask[0].bool()], torch.tensor(turn), torch.tensor(between.ids, dtype=torch.long)])
    return EncodedPrompt(context, append_model_inputs(inputs[0], between.model_inputs), list(between.images))


def test_contexts_with_returned_images_are_sampled_as_the_trainer_scores_them(vlm_path, device):
    model, processor, _ = load_model_and_processor(vlm_path, dtype=device.torch_dtype)
    model = model.to(device.name).eval()
    sample = Sample(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Findings?"}]}],
                    images=[picture((200, 30, 30))], index=0)
    contexts = [dialogue_context(processor, sample, returned) for returned in (0, 1, 2)]
    assert [len(c.model_inputs["image_grid_thw"]) for c in contexts] == [1, 2, 3]
    engine = start_engine(model, processor, vlm_path, device, max_response_length=16, limit_images=3)
    try:
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3, return_log_probs=True)
        # rollout_batch_from_vllm refuses a prompt vLLM expanded otherwise than grouprl's context
        batch = engine.generate([sample] * 3, params, prompts=contexts)
    finally:
        engine.close()
    for g, context in enumerate(contexts):  # each context as given, for its n rows
        for row in (2 * g, 2 * g + 1):
            assert torch.equal(batch.prompt_ids[row][batch.prompt_mask[row].bool()], context.ids)
    with torch.no_grad():
        trained, _ = compute_log_probs(model, batch, micro_batch_size=2)
    assert_same_log_probs(batch.rollout_log_probs.cpu(), trained.cpu(), batch.response_mask, device,
                          "contexts with 0, 1 and 2 returned images")
