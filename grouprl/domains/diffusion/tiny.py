"""Tiny flow-matching models and their tokenizers built offline, for tests and the CPU demo.

Both builders save what they build and ``grouprl.domains.diffusion.models.load_flow_model``
loads it back, so tests exercise the loading path of a real checkpoint:

* ``build_tiny_sd3_pipeline``: a complete ``StableDiffusion3Pipeline`` with SD3.5's three
  text encoders (two CLIPs and a T5) and a small VAE, written by ``save_pretrained``;
* ``build_tiny_pixel_flow``: the demo model, an SD3 transformer that works directly on
  RGB pixels, with one small CLIP text encoder, in grouprl's ``flow_model.json`` layout.

The tokenizers are built here from a corpus (by default the shapes task's prompts):
CLIP byte-level BPEs, and a T5 unigram tokenizer with a piece per word. diffusers' own
tiny test fixtures download theirs from the hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from grouprl.domains.diffusion import shapes
from grouprl.domains.diffusion.models import FLOW_FORMAT, FLOW_INDEX
from grouprl.files import follow_umask

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
_END_OF_WORD = "</w>"
# CLIPTokenizer's own normalisation and word split; training with the same ones makes
# the learnt merges those the loaded tokenizer applies.
_CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def _byte_symbols() -> list[str]:
    """The 256 byte-level symbols, in byte order (the printable-unicode stand-ins GPT-2 and CLIP use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return [symbols[b] for b in range(256)]


def build_clip_tokenizer(corpus: Sequence[str], *, model_max_length: int = 77):
    """A ``CLIPTokenizer`` whose merges make every word of ``corpus`` one token.

    The vocabulary is laid out as CLIP's: the 256 byte symbols, the same with the
    end-of-word mark, the merges in order, then ``<|startoftext|>`` and
    ``<|endoftext|>`` (also the padding token). Any text encodes: words the corpus
    never had fall back to byte symbols.
    """
    from transformers import CLIPTokenizer

    corpus = list(corpus)
    if not corpus or not all(isinstance(text, str) for text in corpus):
        raise ValueError("build_clip_tokenizer: corpus must be a non-empty list of strings")
    backend = Tokenizer(models.BPE(end_of_word_suffix=_END_OF_WORD))
    backend.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    # Room for every merge the corpus offers: training stops when no pair is left.
    trainer = trainers.BpeTrainer(vocab_size=1_000_000, min_frequency=1, end_of_word_suffix=_END_OF_WORD,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus, trainer=trainer)
    merges = [tuple(pair) for pair in json.loads(backend.to_str())["model"]["merges"]]

    symbols = _byte_symbols()
    vocab: dict[str, int] = {}
    for token in [*symbols, *(s + _END_OF_WORD for s in symbols), *(a + b for a, b in merges), BOS_TOKEN, EOS_TOKEN]:
        vocab.setdefault(token, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


T5_PAD, T5_EOS, T5_UNK = "<pad>", "</s>", "<unk>"
_METASPACE = "\u2581"  # SentencePiece's word-start mark
# Pieces for text the corpus never had: each printable ASCII character, alone and word-initial.
_T5_FALLBACK = [chr(c) for c in range(ord("!"), ord("~") + 1)]


def build_t5_tokenizer(corpus: Sequence[str], *, model_max_length: int = 256):
    """A ``T5TokenizerFast`` (a unigram model, as T5's SentencePiece one) with a piece per word of ``corpus``.

    T5's layout: ``<pad>`` 0, ``</s>`` 1 (appended to every text), ``<unk>`` 2, then the
    pieces; words split at whitespace and take SentencePiece's word-start mark. Every
    whitespace-separated word of the corpus is one piece; other text falls back to
    single characters (any printable ASCII character encodes; others are ``<unk>``).
    No ``<extra_id_N>`` sentinels: an encoder-only T5 never sees them.
    """
    from transformers import T5TokenizerFast

    corpus = list(corpus)
    if not corpus or not all(isinstance(text, str) for text in corpus):
        raise ValueError("build_t5_tokenizer: corpus must be a non-empty list of strings")
    words = sorted({word for text in corpus for word in text.split()})
    chars = sorted(set(_T5_FALLBACK) | {c for word in words for c in word})
    # Unigram log-probabilities: a whole word (-1) always beats spelling it out (-5 a character).
    pieces = [(T5_PAD, 0.0), (T5_EOS, 0.0), (T5_UNK, 0.0), (_METASPACE, -2.0)]
    pieces += [(_METASPACE + word, -1.0) for word in words]
    pieces += [(piece, -5.0) for c in chars for piece in (_METASPACE + c, c)]
    vocab: dict[str, float] = {}
    for piece, score in pieces:  # a one-letter word's piece keeps its word score
        vocab.setdefault(piece, score)
    backend = Tokenizer(models.Unigram(list(vocab.items()), unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement=_METASPACE, prepend_scheme="always", split=True),
    ])
    backend.decoder = decoders.Metaspace(replacement=_METASPACE, prepend_scheme="always", split=True)
    # T5's own end of text (transformers 5 sets the same template itself; 4.x keeps this one)
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", T5_EOS], pair=["$A", T5_EOS, "$B", T5_EOS], special_tokens=[(T5_EOS, 1)])
    return T5TokenizerFast(tokenizer_object=backend, eos_token=T5_EOS, unk_token=T5_UNK, pad_token=T5_PAD,
                           extra_ids=0, model_max_length=model_max_length)


def _seeded(seed: int, build: Callable):
    # Fork the RNG so building a model does not move the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _clip_text_encoder(tokenizer, *, seed: int, hidden_size: int, projection_dim: int, layers: int, heads: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=projection_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=tokenizer.model_max_length,
        # The pooled vector is read at the first EOS: CLIP finds it by this id.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _seeded(seed, lambda: CLIPTextModelWithProjection(config).eval())


def _t5_encoder(tokenizer, *, seed: int, hidden_size: int, layers: int, heads: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=hidden_size,
        d_kv=hidden_size // heads,
        d_ff=2 * hidden_size,
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return _seeded(seed, lambda: T5EncoderModel(config).eval())


def build_tiny_sd3_pipeline(
    out_dir: str | Path,
    *,
    seed: int = 0,
    sample_size: int = 32,
    corpus: Sequence[str] | None = None,
    num_layers: int = 1,
    num_attention_heads: int = 4,
    attention_head_dim: int = 8,
    text_hidden_size: int = 32,
    t5: bool = True,
    vae_blocks: int = 1,
    shift: float = 3.0,
    dual_attention: bool = False,
) -> Path:
    """Build a randomly initialised ``StableDiffusion3Pipeline`` and ``save_pretrained`` it to ``out_dir``.

    ``sample_size`` is the latent side; images are ``sample_size * 2 ** (vae_blocks - 1)``
    pixels (32 by default, one VAE block not downsampling). The text side is SD3.5's:

    * two CLIPs, two layers of ``text_hidden_size`` each (SD3 reads their second-last
      hidden states), 77 tokens; their pooled vectors concatenate to the transformer's
      ``pooled_projection_dim``, their tokens side by side to ``2 * text_hidden_size``;
    * a T5 encoder (one layer, width ``4 * text_hidden_size``, twice the CLIPs' together,
      as SD3.5's 4096 is twice 768 + 1280) whose width is the transformer's
      ``joint_attention_dim``: SD3 zero-pads the CLIP tokens to it and appends the T5
      tokens, so a prompt is 77 + ``max_sequence_length`` tokens.

    ``t5=False`` leaves T5 out (``text_encoder_3`` and ``tokenizer_3`` None), as SD3
    allows: the joint width is then the CLIPs' and the T5 tokens are zeros; diffusers
    loads such a directory with ``from_pretrained(out_dir, text_encoder_3=None,
    tokenizer_3=None)``. ``shift`` is SD3's scheduler shift. ``dual_attention``: every block is
    one of SD3.5's dual-attention blocks (a second, image-only attention ``attn2``).
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    out_dir = Path(out_dir)
    if vae_blocks < 1:
        raise ValueError(f"build_tiny_sd3_pipeline: vae_blocks must be >= 1, got {vae_blocks}")
    corpus = list(corpus) if corpus is not None else shapes.corpus()
    latent_channels = 4
    t5_hidden_size = 4 * text_hidden_size
    joint_attention_dim = t5_hidden_size if t5 else 2 * text_hidden_size
    transformer = _seeded(seed, lambda: SD3Transformer2DModel(
        sample_size=sample_size,
        patch_size=2,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=num_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=joint_attention_dim,
        caption_projection_dim=num_attention_heads * attention_head_dim,
        pooled_projection_dim=2 * text_hidden_size,
        pos_embed_max_size=sample_size // 2,
        dual_attention_layers=tuple(range(num_layers)) if dual_attention else (),
    ))
    vae = _seeded(seed + 1, lambda: AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * vae_blocks,
        up_block_types=("UpDecoderBlock2D",) * vae_blocks,
        block_out_channels=(4,) * vae_blocks,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=1,
        sample_size=sample_size * 2 ** (vae_blocks - 1),
        # SD3's VAE factors, so decode/encode exercise the shift as well as the scale.
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ))
    encoders, tokenizers = [], []
    for i in range(2):
        tokenizer = build_clip_tokenizer(corpus)
        tokenizers.append(tokenizer)
        encoders.append(_clip_text_encoder(tokenizer, seed=seed + 2 + i, hidden_size=text_hidden_size,
                                           projection_dim=text_hidden_size, layers=2, heads=2))
    if t5:
        tokenizers.append(build_t5_tokenizer(corpus))
        encoders.append(_t5_encoder(tokenizers[2], seed=seed + 4, hidden_size=t5_hidden_size, layers=1, heads=2))
    else:
        tokenizers.append(None)
        encoders.append(None)
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        vae=vae,
        text_encoder=encoders[0],
        tokenizer=tokenizers[0],
        text_encoder_2=encoders[1],
        tokenizer_2=tokenizers[1],
        text_encoder_3=encoders[2],
        tokenizer_3=tokenizers[2],
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    follow_umask(out_dir)  # safetensors writes 0600 files
    return out_dir


def build_tiny_pixel_flow(
    out_dir: str | Path,
    *,
    seed: int = 0,
    image_size: int = 16,
    corpus: Sequence[str] | None = None,
    num_layers: int = 4,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    embed_dim: int = 64,
    text_layers: int = 1,
    max_prompt_tokens: int = 12,
    shift: float = 1.0,
) -> Path:
    """Build the demo's pixel-space flow model and save it to ``out_dir`` (``flow_model.json`` layout).

    An ``SD3Transformer2DModel`` over RGB pixels (3 channels in and out, patches of
    2 x 2: 64 image tokens at 16 x 16; 0.59M parameters with the defaults), a
    ``text_layers``-layer CLIP text encoder of width ``embed_dim`` whose tokens are the
    transformer's context (``joint_attention_dim``) and whose projected EOS state is
    its pooled input, prompts cut at ``max_prompt_tokens`` tokens (the task's longest
    is 8), and a flow-match Euler scheduler with ``shift`` 1: the shift moves steps
    toward high noise, which a 64-token image does not need.

    The text encoder is random and stays frozen: it only has to keep prompts apart,
    which a random transformer does; the flow transformer learns to read it.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    out_dir = Path(out_dir)
    patch = 2
    if image_size % patch:
        raise ValueError(f"build_tiny_pixel_flow: image_size must be even, got {image_size}")
    corpus = list(corpus) if corpus is not None else shapes.corpus()
    tokenizer = build_clip_tokenizer(corpus, model_max_length=max_prompt_tokens)
    transformer = _seeded(seed, lambda: SD3Transformer2DModel(
        sample_size=image_size,
        patch_size=patch,
        in_channels=3,
        out_channels=3,
        num_layers=num_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=embed_dim,
        caption_projection_dim=num_attention_heads * attention_head_dim,
        pooled_projection_dim=embed_dim,
        pos_embed_max_size=image_size // patch,
    ))
    encoder = _clip_text_encoder(tokenizer, seed=seed + 1, hidden_size=embed_dim, projection_dim=embed_dim,
                                 layers=text_layers, heads=2)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)

    out_dir.mkdir(parents=True, exist_ok=True)
    transformer.save_pretrained(out_dir / "transformer", safe_serialization=True)
    scheduler.save_pretrained(out_dir / "scheduler")
    encoder.save_pretrained(out_dir / "text_encoder", safe_serialization=True)
    tokenizer.save_pretrained(out_dir / "tokenizer")
    index = {
        "_format": FLOW_FORMAT,
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "vae": None,
    }
    (out_dir / FLOW_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    follow_umask(out_dir)  # safetensors writes 0600 files
    return out_dir
