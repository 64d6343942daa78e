"""Tiny models and tokenizers built offline, for tests and the demo.

They are saved with ``save_pretrained`` and loaded back through
``grouprl.models.loading``, so tests exercise the same loading path as a real
Qwen2.5-VL checkpoint from the hub; only the sizes differ.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)

from grouprl.files import follow_umask

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# Same names and roles as Qwen2's special tokens, so code written against the
# tiny models (EOS sets, image-token ids) is the code that runs on real Qwen.
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# Qwen-style ChatML. Image items become <|vision_start|><|image_pad|><|vision_end|>;
# the processor then repeats <|image_pad|> once per merged image patch.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The chat scaffolding is in every prompt; training on it gives roles single tokens.
_TEMPLATE_TEXT = ["system\n", "user\n", "assistant\n", "\n"]

_BYTE_ALPHABET = 256

# Qwen2's pre-tokenizer split. transformers 5 loads any tokenizer saved next to a
# ``qwen2`` config as Qwen2Tokenizer, which rebuilds the pipeline as NFC + this
# split + byte level whatever tokenizer.json says; building ours the same way
# keeps the in-memory tokenizer and every reloaded one token-for-token equal.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(corpus: list[str], *, vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``corpus`` with Qwen2's special tokens and a ChatML template.

    Byte-level means every string encodes and decodes back exactly, even text
    the corpus never contained (after NFC normalisation, as Qwen2's tokenizer
    does). ``vocab_size`` counts the 256 byte tokens, the merges and the
    special tokens; the default leaves room for 256 merges.
    """
    if not corpus or not all(isinstance(text, str) for text in corpus):
        raise ValueError("build_tokenizer: corpus must be a non-empty list of strings")
    if vocab_size is None:
        vocab_size = _BYTE_ALPHABET + len(SPECIAL_TOKENS) + 256
    if vocab_size < _BYTE_ALPHABET + len(SPECIAL_TOKENS):
        raise ValueError(
            f"build_tokenizer: vocab_size={vocab_size} is too small; it must hold the 256 byte tokens "
            f"and {len(SPECIAL_TOKENS)} special tokens (>= {_BYTE_ALPHABET + len(SPECIAL_TOKENS)})"
        )
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(corpus) + _TEMPLATE_TEXT, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD],
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}


def _vocab_for(tokenizer: PreTrainedTokenizerFast) -> int:
    # A multiple of 64, and so larger than the tokenizer, as in real Qwen checkpoints
    # (151936 rows for 151665 tokens): tests then meet ids the tokenizer cannot name.
    return (len(tokenizer) + 63) // 64 * 64


def _embedding_rows(tokenizer: PreTrainedTokenizerFast, model_vocab_size: int | None, builder: str) -> int:
    """The model's vocabulary (embedding rows): ``model_vocab_size``, or the tokenizer's rounded up to 64."""
    if model_vocab_size is None:
        return _vocab_for(tokenizer)
    if model_vocab_size < len(tokenizer):
        raise ValueError(f"{builder}: model_vocab_size={model_vocab_size} is smaller than the tokenizer "
                         f"({len(tokenizer)} tokens); every token id needs an embedding row")
    return int(model_vocab_size)


def _save_model(model, out_dir: Path, save_dtype) -> None:
    """Save ``model`` (cast to ``save_dtype`` first when given: "bfloat16", torch.bfloat16, ...)."""
    if save_dtype is not None:
        dtype = getattr(torch, save_dtype) if isinstance(save_dtype, str) else save_dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"save_dtype must name a floating-point torch dtype, got {save_dtype!r}")
        model = model.to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)


def _generation_config(ids: dict[str, int]) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=[ids[IM_END], ids[PAD_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
    )


def _seeded_init(seed: int, build):
    # Fork the RNG so building a model does not move the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_tiny_vlm(
    out_dir: str | Path,
    corpus: list[str],
    *,
    seed: int = 0,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    patch_size: int = 14,
    image_size: int = 112,
    vocab_size: int | None = None,
    model_vocab_size: int | None = None,
    vision_intermediate_size: int | None = None,
    window_size: int | None = None,
    fullatt_block_indexes: list[int] | None = None,
    mrope_section: list[int] | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 4096,
    save_dtype: str | torch.dtype | None = None,
) -> Path:
    """Build a randomly initialised Qwen2.5-VL with its processor and save both to ``out_dir``.

    The language model and the vision tower are a few layers of width
    ``hidden_size`` / ``vision_hidden_size``; the image processor resizes images
    to about ``image_size`` x ``image_size`` pixels, which gives
    ``(image_size / patch_size / 2) ** 2`` image tokens per image (16 for the
    defaults). Token ids in the config are the tokenizer's.

    The other options reach a real checkpoint's shape with this tokenizer (see
    ``benchmarks/bench_gpu.py``, which builds Qwen2.5-VL-3B's): ``model_vocab_size``
    embedding rows (default: the tokenizer's size rounded up to 64; real checkpoints
    pad further, 151,936 rows), the vision MLP width ``vision_intermediate_size``
    (default ``2 * vision_hidden_size``), the vision attention ``window_size`` in
    pixels (default ``patch_size * 4``) and the blocks that attend over the whole
    image, ``fullatt_block_indexes`` (default the last), M-RoPE's
    ``mrope_section`` (temporal, height, width parts of half a head; default split
    evenly), ``rope_theta``, ``max_position_embeddings``, and ``save_dtype``, the
    dtype of the saved weights (default float32; the hub ships bfloat16).
    """
    out_dir = Path(out_dir)
    head_dim = hidden_size // heads
    if hidden_size % heads or head_dim % 2:
        raise ValueError(f"build_tiny_vlm: hidden_size={hidden_size} must split into {heads} heads of even size")
    if vision_hidden_size % vision_heads:
        raise ValueError(
            f"build_tiny_vlm: vision_hidden_size={vision_hidden_size} is not divisible by vision_heads={vision_heads}"
        )
    merge = 2
    if image_size % (patch_size * merge):
        raise ValueError(
            f"build_tiny_vlm: image_size={image_size} must be a multiple of patch_size*2={patch_size * merge}"
        )
    if fullatt_block_indexes is not None and not all(0 <= i < vision_depth for i in fullatt_block_indexes):
        raise ValueError(f"build_tiny_vlm: fullatt_block_indexes={fullatt_block_indexes} must index the "
                         f"{vision_depth} vision blocks")
    # M-RoPE splits the rotary half-dimension into temporal/height/width sections.
    half = head_dim // 2
    if mrope_section is None:
        mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    elif len(mrope_section) != 3 or sum(mrope_section) != half:
        raise ValueError(f"build_tiny_vlm: mrope_section={mrope_section} must be 3 parts summing to half the "
                         f"head size ({half})")
    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size)
    ids = _special_ids(tokenizer)
    text_config = dict(
        vocab_size=_embedding_rows(tokenizer, model_vocab_size, "build_tiny_vlm"),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=layers,
        # The hub checkpoints' spelling, which every transformers version since 4.49 reads.
        rope_scaling={"type": "mrope", "mrope_section": list(mrope_section)},
        rope_theta=rope_theta,
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD_TOKEN],
    )
    vision_config = dict(
        depth=vision_depth,
        hidden_size=vision_hidden_size,
        intermediate_size=vision_intermediate_size or 2 * vision_hidden_size,
        num_heads=vision_heads,
        patch_size=patch_size,
        spatial_merge_size=merge,
        temporal_patch_size=2,
        out_hidden_size=hidden_size,
        # Windows of 2x2 merged patches in every block but the last, which
        # attends over the whole image, as the real model alternates them.
        window_size=window_size or patch_size * merge * 2,
        fullatt_block_indexes=list(fullatt_block_indexes) if fullatt_block_indexes is not None else [vision_depth - 1],
    )
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    model = _seeded_init(seed, lambda: Qwen2_5_VLForConditionalGeneration(config))
    model.generation_config = _generation_config(ids)

    image_processor = Qwen2VLImageProcessor(
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=merge,
        min_pixels=(patch_size * merge) ** 2,
        max_pixels=image_size * image_size,
    )
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        # Built explicitly: the default constructor path would look for files on the hub.
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_model(model, out_dir, save_dtype)
    processor.save_pretrained(out_dir)
    follow_umask(out_dir)  # safetensors writes 0600 files
    return out_dir


def build_tiny_text_lm(
    out_dir: str | Path,
    corpus: list[str],
    *,
    seed: int = 0,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    attention_dropout: float = 0.0,
    model_vocab_size: int | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 4096,
    save_dtype: str | torch.dtype | None = None,
    chat_template: str | None = None,
) -> Path:
    """Build a randomly initialised Qwen2 causal LM with the tokenizer and save both to ``out_dir``.

    ``attention_dropout`` > 0 makes every training forward draw from torch's RNG (tests of
    exact resume need a run that does). ``model_vocab_size`` (embedding rows, default the
    tokenizer's size rounded up to 64), ``rope_theta``, ``max_position_embeddings`` and
    ``save_dtype`` (default float32) are as in ``build_tiny_vlm``. ``chat_template``: the tokenizer's
    template instead of the ChatML :data:`CHAT_TEMPLATE` (one that renders tools, for tool use).
    """
    out_dir = Path(out_dir)
    if hidden_size % heads:
        raise ValueError(f"build_tiny_text_lm: hidden_size={hidden_size} is not divisible by heads={heads}")
    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    ids = _special_ids(tokenizer)
    config = Qwen2Config(
        vocab_size=_embedding_rows(tokenizer, model_vocab_size, "build_tiny_text_lm"),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=layers,
        rope_theta=rope_theta,
        attention_dropout=attention_dropout,
        tie_word_embeddings=True,
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD_TOKEN],
    )
    model = _seeded_init(seed, lambda: Qwen2ForCausalLM(config))
    model.generation_config = _generation_config(ids)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_model(model, out_dir, save_dtype)
    tokenizer.save_pretrained(out_dir)
    follow_umask(out_dir)  # safetensors writes 0600 files
    return out_dir
