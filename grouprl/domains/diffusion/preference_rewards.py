"""Preference-model image rewards: PickScore, HPSv2, ImageReward, CLIP score and the LAION aesthetic predictor.

Each is an image reward (the core's contract, :data:`grouprl.rewards.IMAGE`)
``fn(images, prompts, **metadata) -> list[float]`` registered by the diffusion plugin as
``pickscore``, ``hpsv2``, ``image_reward``, ``clip_score`` and ``aesthetic``. Each loads
LOCAL weights named by its options (``model=`` a path, or a hub id found in the local
Hugging Face cache: nothing is downloaded, as with ``HF_HUB_OFFLINE=1``), through the
library the original uses (transformers' CLIP for PickScore, CLIP score and the
aesthetic predictor's image tower; open_clip for HPSv2; transformers' BLIP for
ImageReward, whose published checkpoint in BLIP's own layout is converted on load), and
scores as Flow-GRPO (github.com/yifan123/flow_grpo) does; each function's docstring
names its source file and the formula.

Common options: ``device`` (default ``"cpu"``) and ``batch_size`` (images per forward
pass, default 16: the scores do not depend on it). A model is loaded once per (reward,
weights, device) and kept for the process (:func:`clear_model_cache` drops them), so a
reward set scoring every step does not reload it. Scores are computed in float32 with
gradients off.
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

# The extra holding open_clip (HPSv2); the transformers-based rewards need none.
PREFERENCE_EXTRA = "preference"

# Flow-GRPO's rescaling of the CLIP-style logits (exp(logit_scale) * cos, about 20-30 on real
# weights) to about [0, 1]: flow_grpo/pickscore_scorer.py divides by 26, flow_grpo/clip_scorer.py by 30.
PICKSCORE_DIVISOR = 26.0
CLIP_SCORE_DIVISOR = 30.0

# ImageReward's normalisation of its MLP output (ImageReward/ImageReward.py of the image-reward
# package 1.5, the class ImageReward: self.mean, self.std), and its prompt length (max_length=35).
IMAGE_REWARD_MEAN = 0.16717362830052426
IMAGE_REWARD_STD = 1.0333394966054072
IMAGE_REWARD_MAX_TOKENS = 35
IMAGE_REWARD_HEAD_FILE = "image_reward_mlp.safetensors"

# The hidden sizes of the LAION aesthetic predictor's MLP and of ImageReward's (the same layout:
# Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear, Linear; no activations).
_PREFERENCE_MLP_HIDDEN = (1024, 128, 64, 16)
# CLIP's image normalisation (OpenAI's), which ImageReward's preprocessing uses too.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ---------------------------------------------------------------------------- locating weights


def _needs(extra: str | None) -> str:
    return (f"the reward needs pip install 'grouprl[{extra}]'" if extra
            else "the reward is loaded with transformers, which grouprl installs (no extra needed)")


def resolve_weights(reference: str, *, reward: str, option: str = "model", filename: str | None = None,
                    extra: str | None = None) -> Path:
    """The local path of ``reference``: itself when it exists, else the hub id's snapshot (or its file
    ``filename``) in the local Hugging Face cache. Nothing is downloaded.

    Raises FileNotFoundError naming the reward, the option, the reference and the extra.
    """
    if not isinstance(reference, str) or not reference.strip():
        raise ValueError(f"{reward}: the option {option!r} must be a path or a hub id, got {reference!r}")
    path = Path(reference).expanduser()
    if path.exists():
        return path
    looks_like_hub_id = reference.count("/") == 1 and not reference.startswith((".", "/", "~"))
    if looks_like_hub_id:
        try:
            from huggingface_hub import hf_hub_download, snapshot_download

            if filename is None:
                return Path(snapshot_download(reference, local_files_only=True))
            return Path(hf_hub_download(reference, filename, local_files_only=True))
        except Exception:  # noqa: BLE001 - every miss of the cache is the same error for the user
            pass
    where = f"{reference!r}" + (f" (file {filename!r})" if filename and looks_like_hub_id else "")
    raise FileNotFoundError(
        f"{reward}: {option} {where} is neither an existing path nor a hub id in the local Hugging Face cache "
        f"(nothing is downloaded); download it (huggingface-cli download) or pass its path; {_needs(extra)}")


# ---------------------------------------------------------------------------- the model cache

_MODELS: dict[tuple, Any] = {}
_LOAD_LOCK = threading.Lock()


def cached_model(key: tuple, load: Callable[[], Any]) -> Any:
    """The object ``load()`` built for ``key`` (reward name, resolved paths, device, options), built once.

    One lock around loading: two threads asking for the same model load it once.
    """
    with _LOAD_LOCK:
        if key not in _MODELS:
            _MODELS[key] = load()
        return _MODELS[key]


def clear_model_cache() -> None:
    """Drop every loaded preference model (the next call loads again)."""
    with _LOAD_LOCK:
        _MODELS.clear()


def _check_batch(reward: str, images: Sequence[Any], prompts: Sequence[str], batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{reward}: batch_size must be a positive integer, got {batch_size!r}")
    if len(images) != len(prompts):
        raise ValueError(f"{reward}: got {len(prompts)} prompts for {len(images)} images")


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def _pooled(output: Any) -> Any:
    """The projected embedding of ``get_image_features`` / ``get_text_features``: a tensor in
    transformers 4, the ``pooler_output`` of the returned output in transformers 5."""
    return getattr(output, "pooler_output", output)


def preference_mlp(input_size: int):
    """The MLP of the LAION aesthetic predictor and of ImageReward: input_size -> 1024 -> 128 -> 64 -> 16 -> 1,
    linear layers with dropout between the first four and no activation, held as ``.layers`` so that the
    state dict has the published keys ``layers.0``, ``layers.2``, ``layers.4``, ``layers.6``, ``layers.7``.
    Called on ``(batch, input_size)``, it gives ``(batch, 1)``."""
    from torch import nn

    a, b, c, d = _PREFERENCE_MLP_HIDDEN
    mlp = nn.Module()
    mlp.layers = nn.Sequential(nn.Linear(input_size, a), nn.Dropout(0.2), nn.Linear(a, b), nn.Dropout(0.2),
                               nn.Linear(b, c), nn.Dropout(0.1), nn.Linear(c, d), nn.Linear(d, 1))
    mlp.forward = mlp.layers.forward
    return mlp


def _load_state_dict(path: Path) -> dict[str, Any]:
    """A state dict from ``.safetensors`` or a torch pickle (tensors only: ``weights_only``); a checkpoint
    holding it under ``state_dict`` (HPSv2's) gives that."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    import torch

    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def _load_mlp(path: Path, *, reward: str, prefix: str = ""):
    """The :func:`preference_mlp` with the weights of ``path`` (keys ``{prefix}layers.N.*``), in eval mode."""
    state = {k[len(prefix):]: v for k, v in _load_state_dict(path).items() if k.startswith(prefix)}
    if "layers.0.weight" not in state:
        raise ValueError(f"{reward}: {path} has no '{prefix}layers.0.weight': not the published MLP's state dict")
    mlp = preference_mlp(int(state["layers.0.weight"].shape[1]))
    mlp.load_state_dict(state)
    return mlp.eval()


# ---------------------------------------------------------------------------- CLIP (transformers): PickScore, CLIP score


@dataclass
class _Clip:
    model: Any
    processor: Any
    device: str


def _load_clip(reward: str, model: str, processor: str | None, device: str) -> _Clip:
    model_path = resolve_weights(model, reward=reward)
    processor_path = resolve_weights(processor, reward=reward, option="processor") if processor else model_path

    def load() -> _Clip:
        from transformers import CLIPModel, CLIPProcessor

        clip = CLIPModel.from_pretrained(str(model_path), local_files_only=True, dtype="float32")
        return _Clip(clip.to(device).eval(), CLIPProcessor.from_pretrained(str(processor_path), local_files_only=True),
                     device)

    return cached_model((reward, str(model_path), str(processor_path), device), load)


def _clip_logits(clip: _Clip, images: Sequence[Any], prompts: Sequence[str], batch_size: int,
                 padding: str | bool) -> list[float]:
    """exp(logit_scale) * cos(image_embed_i, text_embed_i) for each row (CLIP's logits_per_image diagonal)."""
    import torch

    scores: list[float] = []
    with torch.no_grad():
        for rows in _chunks(len(images), batch_size):
            pixels = clip.processor(images=[image.convert("RGB") for image in images[rows]], return_tensors="pt")
            text = clip.processor(text=list(prompts[rows]), padding=padding, truncation=True, max_length=77,
                                  return_tensors="pt")
            image_embeds = _pooled(clip.model.get_image_features(pixel_values=pixels["pixel_values"].to(clip.device)))
            text_embeds = _pooled(clip.model.get_text_features(input_ids=text["input_ids"].to(clip.device),
                                                                attention_mask=text["attention_mask"].to(clip.device)))
            image_embeds = image_embeds / image_embeds.norm(p=2, dim=-1, keepdim=True)
            text_embeds = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
            cos = (image_embeds * text_embeds).sum(-1)
            scores.extend((clip.model.logit_scale.exp() * cos).float().cpu().tolist())
    return scores


def pickscore_reward(
    images: Sequence[Any], prompts: Sequence[str], *, model: str = "yuvalkirstain/PickScore_v1",
    processor: str | None = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", divisor: float = PICKSCORE_DIVISOR,
    device: str = "cpu", batch_size: int = 16, **metadata: Any,
) -> list[float]:
    """PickScore (Kirstain et al. 2023) as Flow-GRPO scores it (flow_grpo/pickscore_scorer.py):
    exp(logit_scale) * cos(image_embed, text_embed) / ``divisor`` (26: "norm to 0-1").

    ``model``: a transformers ``CLIPModel`` checkpoint (PickScore_v1); ``processor``: the
    ``CLIPProcessor`` (PickScore's is laion/CLIP-ViT-H-14-laion2B-s32B-b79K's; None: the
    model's directory). The prompt is tokenised with padding and truncation to 77 tokens;
    images go through the processor (resize, centre crop, CLIP normalisation).
    """
    _check_batch("pickscore", images, prompts, batch_size)
    if not images:
        return []
    clip = _load_clip("pickscore", model, processor, device)
    return [score / divisor for score in _clip_logits(clip, images, prompts, batch_size, padding=True)]


def clip_score_reward(
    images: Sequence[Any], prompts: Sequence[str], *, model: str = "openai/clip-vit-large-patch14",
    processor: str | None = None, divisor: float = CLIP_SCORE_DIVISOR, device: str = "cpu", batch_size: int = 16,
    **metadata: Any,
) -> list[float]:
    """CLIP score as Flow-GRPO computes it (flow_grpo/clip_scorer.py, from RE-N-Y/imscore):
    CLIP's ``logits_per_image`` diagonal, exp(logit_scale) * cos(image_embed, text_embed), / ``divisor`` (30).

    ``model``: a transformers ``CLIPModel`` checkpoint (openai/clip-vit-large-patch14), its
    ``CLIPProcessor`` in the same directory unless ``processor`` names another. Prompts are
    padded to the maximum length (77) and truncated, as Flow-GRPO does. Flow-GRPO resizes
    float tensors with torchvision (bilinear); here the processor resizes the PIL image
    (bicubic, CLIP's own preprocessing): scores differ slightly from Flow-GRPO's.
    """
    _check_batch("clip_score", images, prompts, batch_size)
    if not images:
        return []
    clip = _load_clip("clip_score", model, processor, device)
    return [score / divisor for score in _clip_logits(clip, images, prompts, batch_size, padding="max_length")]


# ---------------------------------------------------------------------------- aesthetic (transformers CLIP + the LAION MLP)


def aesthetic_reward(
    images: Sequence[Any], prompts: Sequence[str], *, head: str, model: str = "openai/clip-vit-large-patch14",
    head_filename: str = "sac+logos+ava1-l14-linearMSE.pth", device: str = "cpu", batch_size: int = 16,
    **metadata: Any,
) -> list[float]:
    """The LAION aesthetic predictor (christophschuhmann/improved-aesthetic-predictor) as Flow-GRPO runs it
    (flow_grpo/aesthetic_scorer.py): MLP(e / |e|), e the CLIP ViT-L/14 image embedding
    (``get_image_features``); the raw predicted rating (about 1-10 on the published weights), not rescaled.

    ``head``: the MLP's state dict (sac+logos+ava1-l14-linearMSE.pth: keys ``layers.0`` ...
    ``layers.7``, see :func:`preference_mlp`), a path or a hub repo holding ``head_filename``;
    ``model``: the transformers ``CLIPModel`` and its ``CLIPProcessor``. The prompt is not used.
    """
    _check_batch("aesthetic", images, prompts, batch_size)
    if not images:
        return []
    import torch

    model_path = resolve_weights(model, reward="aesthetic")
    head_path = resolve_weights(head, reward="aesthetic", option="head",
                                filename=head_filename if not Path(head).expanduser().exists() else None)

    def load():
        from transformers import CLIPModel, CLIPProcessor

        clip = CLIPModel.from_pretrained(str(model_path), local_files_only=True, dtype="float32").to(device).eval()
        mlp = _load_mlp(head_path, reward="aesthetic").to(device)
        if mlp.layers[0].in_features != clip.config.projection_dim:
            raise ValueError(f"aesthetic: the head {head_path} takes {mlp.layers[0].in_features}-d embeddings, the CLIP "
                             f"model {model_path} gives {clip.config.projection_dim}-d ones")
        return clip, CLIPProcessor.from_pretrained(str(model_path), local_files_only=True), mlp

    clip, processor, mlp = cached_model(("aesthetic", str(model_path), str(head_path), device), load)
    scores: list[float] = []
    with torch.no_grad():
        for rows in _chunks(len(images), batch_size):
            pixels = processor(images=[image.convert("RGB") for image in images[rows]], return_tensors="pt")
            embed = _pooled(clip.get_image_features(pixel_values=pixels["pixel_values"].to(device)))
            embed = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
            scores.extend(mlp(embed).squeeze(1).float().cpu().tolist())
    return scores


# ---------------------------------------------------------------------------- HPSv2 (open_clip)


def _import_open_clip():
    try:
        import open_clip
    except ImportError as exc:
        raise ImportError("the 'hpsv2' image reward needs open_clip: pip install 'grouprl[preference]' "
                          "(or pip install open_clip_torch)") from exc
    return open_clip


def _open_clip_arch(open_clip: Any, arch: str) -> str:
    """The open_clip model name for ``arch``: a registered name, or the path of a model config JSON
    (registered here under its file stem, :func:`open_clip.add_model_config`)."""
    path = Path(arch).expanduser()
    if arch.endswith(".json"):
        if not path.is_file():
            raise FileNotFoundError(f"hpsv2: arch config {arch!r} does not exist; {_needs(PREFERENCE_EXTRA)}")
        open_clip.add_model_config(str(path))
        return path.stem
    if arch not in open_clip.list_models():
        raise ValueError(f"hpsv2: arch {arch!r} is not an open_clip model (HPSv2 is ViT-H-14), nor a config .json")
    return arch


def hpsv2_reward(
    images: Sequence[Any], prompts: Sequence[str], *, model: str = "xswu/HPSv2",
    filename: str = "HPS_v2.1_compressed.pt", arch: str = "ViT-H-14", device: str = "cpu", batch_size: int = 16,
    **metadata: Any,
) -> list[float]:
    """HPSv2 (Wu et al. 2023) as the hpsv2 package scores it (hpsv2/img_score.py; flow_grpo/hpsv2_scorer.py the
    same): image_features . text_features, both L2-normalised open_clip embeddings (no logit scale, no rescaling).

    ``model``: the checkpoint (HPS_v2.1_compressed.pt: a dict with ``state_dict``), a path or
    the hub repo holding ``filename``; ``arch``: the open_clip architecture (ViT-H-14) or a
    model config JSON. The image preprocessing is HPSv2's evaluation transform: the longer
    side resized to the model's image size (bicubic), centred on a black square, CLIP's
    normalisation; the tokenizer is open_clip's for ``arch`` (77 tokens). HPSv2 runs
    ViT-H-14 under CUDA autocast (fp16); here float32, and the resize is done on the PIL
    image (open_clip's ``resize_mode='longest'``) where hpsv2's older transform resizes the
    tensor. Needs ``pip install 'grouprl[preference]'`` (open_clip_torch).
    """
    _check_batch("hpsv2", images, prompts, batch_size)
    if not images:
        return []
    open_clip = _import_open_clip()
    import torch

    path = resolve_weights(model, reward="hpsv2", filename=filename if not Path(model).expanduser().exists() else None,
                           extra=PREFERENCE_EXTRA)
    name = _open_clip_arch(open_clip, arch)

    def load():
        from open_clip.transform import image_transform

        clip = open_clip.create_model(name, pretrained=None, device=device)
        clip.load_state_dict(_load_state_dict(path))
        clip.eval()
        preprocess = image_transform(clip.visual.image_size, is_train=False, mean=open_clip.OPENAI_DATASET_MEAN,
                                     std=open_clip.OPENAI_DATASET_STD, resize_mode="longest", fill_color=0)
        return clip, preprocess, open_clip.get_tokenizer(name)

    clip, preprocess, tokenizer = cached_model(("hpsv2", str(path), name, device), load)
    scores: list[float] = []
    with torch.no_grad():
        for rows in _chunks(len(images), batch_size):
            pixels = torch.stack([preprocess(image.convert("RGB")) for image in images[rows]]).to(device)
            image_features = clip.encode_image(pixels, normalize=True)
            text_features = clip.encode_text(tokenizer(list(prompts[rows])).to(device), normalize=True)
            scores.extend((image_features * text_features).sum(-1).float().cpu().tolist())
    return scores


# ---------------------------------------------------------------------------- ImageReward's published checkpoint

IMAGE_REWARD_HUB_ID = "THUDM/ImageReward"
IMAGE_REWARD_CHECKPOINT = "ImageReward.pt"
IMAGE_REWARD_MED_CONFIG = "med_config.json"
IMAGE_REWARD_TOKENIZER = "google-bert/bert-base-uncased"
# ImageReward's tokenizer is bert-base-uncased plus BLIP's two special tokens (ImageReward/models/BLIP/blip.py,
# init_tokenizer); the published text encoder's vocabulary (30524) counts them.
_BLIP_SPECIAL_TOKENS = ({"bos_token": "[DEC]"}, {"additional_special_tokens": ["[ENC]"]})
# BLIP's ViTs (blip.py, create_vit: base 768 wide with 12 heads, large 1024 wide with 16) have 64-wide heads;
# the head count is not in the weights. Their LayerNorms use eps 1e-6 (vit.py; transformers' default is 1e-5).
_BLIP_VIT_HEAD_DIM = 64
_BLIP_VIT_LAYER_NORM_EPS = 1e-6

# (original name, transformers name), "{i}" a layer index; a name ending in "." renames a module and keeps the
# tensor names under it. Original names: ImageReward/models/BLIP/vit.py (VisionTransformer: patch_embed.proj,
# cls_token, pos_embed, blocks.N.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}, norm), med.py (BLIP's
# fork of BERT: the same names as transformers' BlipTextModel) and ImageReward.py (ImageReward.blip,
# ImageReward.mlp); transformers' names: BlipForImageTextRetrieval (modeling_blip.py, modeling_blip_text.py).
_IMAGE_REWARD_KEYS = (
    ("blip.visual_encoder.cls_token", "vision_model.embeddings.class_embedding"),
    ("blip.visual_encoder.pos_embed", "vision_model.embeddings.position_embedding"),
    ("blip.visual_encoder.patch_embed.proj.", "vision_model.embeddings.patch_embedding."),
    ("blip.visual_encoder.blocks.{i}.norm1.", "vision_model.encoder.layers.{i}.layer_norm1."),
    # q, k and v are one fused Linear in both, rows [q; k; v] read as (3, heads, head_dim): copied as is.
    ("blip.visual_encoder.blocks.{i}.attn.qkv.", "vision_model.encoder.layers.{i}.self_attn.qkv."),
    ("blip.visual_encoder.blocks.{i}.attn.proj.", "vision_model.encoder.layers.{i}.self_attn.projection."),
    ("blip.visual_encoder.blocks.{i}.norm2.", "vision_model.encoder.layers.{i}.layer_norm2."),
    ("blip.visual_encoder.blocks.{i}.mlp.", "vision_model.encoder.layers.{i}.mlp."),
    ("blip.visual_encoder.norm.", "vision_model.post_layernorm."),
    ("blip.text_encoder.", "text_encoder."),
    ("mlp.layers.", "mlp.layers."),
)
# Tensors of ImageReward's BLIP_Pretrain that the score does not use: the contrastive projections and BERT's
# position_ids buffer (an arange that transformers builds itself).
_IMAGE_REWARD_UNUSED = frozenset({"blip.vision_proj.weight", "blip.vision_proj.bias", "blip.text_proj.weight",
                                  "blip.text_proj.bias", "blip.text_encoder.embeddings.position_ids"})


def _rename(key: str, table: Sequence[tuple[str, str]]) -> str | None:
    """``key`` renamed by the first (source, target) template of ``table`` it matches; None if none does."""
    for source, target in table:
        head = r"(\d+)".join(re.escape(part) for part in source.split("{i}"))
        match = re.fullmatch(head + ("(.+)" if source.endswith(".") else "()"), key)
        if match:
            *index, rest = match.groups()
            return (target.replace("{i}", index[0]) if index else target) + rest
    return None


def convert_image_reward_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """ImageReward's published state dict (``ImageReward.pt``: the ImageReward module of
    ImageReward/ImageReward.py, keys ``blip.visual_encoder.*``, ``blip.text_encoder.*``, ``mlp.layers.*``) under
    transformers' names: ``vision_model.*`` and ``text_encoder.*`` as in ``BlipForImageTextRetrieval``, the MLP
    as ``mlp.layers.N.*`` (:func:`preference_mlp`). The tensors are the same objects (no copy, no reshape: the
    ViT's fused qkv is fused in transformers too); the contrastive projections and BERT's ``position_ids`` are
    dropped (unused by the score).

    Raises ValueError naming the keys that are neither mapped nor known to be unused.
    """
    converted, unexpected = {}, []
    for key, value in state.items():
        if key in _IMAGE_REWARD_UNUSED:
            continue
        name = _rename(key, _IMAGE_REWARD_KEYS)
        if name is None:
            unexpected.append(key)
        else:
            converted[name] = value
    if unexpected:
        raise ValueError(f"unexpected keys, not in ImageReward's layout: {_some(unexpected)}")
    return converted


def image_reward_original_key(name: str) -> str:
    """The published checkpoint's key for a converted key (the inverse of :func:`convert_image_reward_state_dict`'s
    renaming), for error messages; ``name`` itself where no template matches."""
    return _rename(name, [(target, source) for source, target in _IMAGE_REWARD_KEYS]) or name


def _some(keys: Sequence[str], shown: int = 5) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def image_reward_blip_configs(state: dict[str, Any], med_config: dict[str, Any]) -> tuple[Any, Any]:
    """The transformers ``(BlipVisionConfig, BlipTextConfig)`` of a converted ImageReward state dict.

    The ViT's sizes are read from the weights (BLIP_Pretrain builds it from the name 'large' and the image size,
    neither stored): width = class_embedding's last dim, patch = the patch conv's kernel, image size = patch *
    sqrt(positions - 1), depth = the number of layers, MLP width = fc1's rows, heads = width / 64, LayerNorm
    eps 1e-6. The text encoder's are med_config.json's BERT fields; its cross-attention width is the ViT's, as
    BLIP_Pretrain sets ``encoder_width = vision_width`` whatever med_config.json says (the published file says
    768 for a 1024-wide ViT-L). Raises ValueError naming a missing tensor or field.
    """
    import math

    from transformers import BlipTextConfig, BlipVisionConfig

    def tensor(name: str) -> Any:
        if name not in state:
            raise ValueError(f"missing key {image_reward_original_key(name)}")
        return state[name]

    width = int(tensor("vision_model.embeddings.class_embedding").shape[-1])
    patch = int(tensor("vision_model.embeddings.patch_embedding.weight").shape[-1])
    positions = int(tensor("vision_model.embeddings.position_embedding").shape[1])
    grid = math.isqrt(positions - 1)
    if grid * grid != positions - 1 or width % _BLIP_VIT_HEAD_DIM:
        raise ValueError(f"blip.visual_encoder is not one of BLIP's ViTs: {positions - 1} patches (not a square) or "
                         f"width {width} (not a multiple of {_BLIP_VIT_HEAD_DIM})")
    layers = 1 + max((int(k.split(".")[3]) for k in state if k.startswith("vision_model.encoder.layers.")), default=-1)
    vision = BlipVisionConfig(
        hidden_size=width, patch_size=patch, image_size=grid * patch, num_hidden_layers=layers,
        intermediate_size=int(tensor("vision_model.encoder.layers.0.mlp.fc1.weight").shape[0]),
        num_attention_heads=width // _BLIP_VIT_HEAD_DIM, layer_norm_eps=_BLIP_VIT_LAYER_NORM_EPS)
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    absent = [field for field in required if field not in med_config]
    if absent:
        raise ValueError(f"{IMAGE_REWARD_MED_CONFIG} has no {', '.join(absent)}")
    text = BlipTextConfig(
        **{field: med_config[field] for field in required}, encoder_hidden_size=width,
        max_position_embeddings=med_config.get("max_position_embeddings", 512),
        hidden_act=med_config.get("hidden_act", "gelu"), layer_norm_eps=med_config.get("layer_norm_eps", 1e-12),
        pad_token_id=med_config.get("pad_token_id", 0), bos_token_id=None, eos_token_id=None, sep_token_id=None)
    return vision, text


# ---------------------------------------------------------------------------- ImageReward (transformers BLIP)


@dataclass
class _ImageRewardNet:
    vision: Any     # BlipVisionModel (ImageReward's blip.visual_encoder)
    text: Any       # BlipTextModel with cross-attention (blip.text_encoder)
    mlp: Any
    tokenizer: Any
    preprocess: Any


def _image_reward_transform(size: int):
    """ImageReward's own _transform (torchvision on the PIL image), not BLIP's processor (a 384 px squash)."""
    from torchvision import transforms

    return transforms.Compose([
        transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC), transforms.CenterCrop(size),
        transforms.ToTensor(), transforms.Normalize(_CLIP_MEAN, _CLIP_STD)])


def _load_image_reward_transformers(path: Path, head: Path, device: str) -> _ImageRewardNet:
    from transformers import AutoTokenizer, BlipForImageTextRetrieval

    blip = BlipForImageTextRetrieval.from_pretrained(str(path), local_files_only=True, dtype="float32").to(device)
    return _ImageRewardNet(blip.vision_model.eval(), blip.text_encoder.eval(),
                           _load_mlp(head, reward="image_reward").to(device),
                           AutoTokenizer.from_pretrained(str(path), local_files_only=True),
                           _image_reward_transform(blip.config.vision_config.image_size))


def _load_image_reward_published(checkpoint: Path, med_config: Path, tokenizer: Path, device: str) -> _ImageRewardNet:
    """The published checkpoint through :func:`convert_image_reward_state_dict` into transformers' BLIP towers
    and :func:`preference_mlp`; every tensor of the towers and the MLP must be in the file (and nothing else)."""
    import json

    from transformers import AutoTokenizer, BlipTextModel, BlipVisionModel

    try:
        state = convert_image_reward_state_dict(_load_state_dict(checkpoint))
        vision_config, text_config = image_reward_blip_configs(state, json.loads(med_config.read_text()))
    except ValueError as exc:
        raise ValueError(f"image_reward: {checkpoint}: {exc}") from None
    parts = {"vision_model.": BlipVisionModel(vision_config), "text_encoder.": BlipTextModel(text_config,
             add_pooling_layer=False), "mlp.": preference_mlp(text_config.hidden_size)}
    expected = {prefix + key for prefix, module in parts.items() for key in module.state_dict()}
    missing = sorted(image_reward_original_key(key) for key in expected - state.keys())
    unexpected = sorted(image_reward_original_key(key) for key in state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"image_reward: {checkpoint} does not fit ImageReward's network (ViT read from the weights, "
                         f"text encoder from {med_config}): " + "; ".join(
                             f"{what} keys {_some(keys)}" for what, keys in (("missing", missing),
                                                                            ("unexpected", unexpected)) if keys))
    for prefix, module in parts.items():
        try:
            module.load_state_dict({key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)})
        except RuntimeError as exc:  # a shape that med_config.json does not give: torch names the tensor
            detail = " ".join(line.strip() for line in str(exc).splitlines()[1:])
            raise ValueError(f"image_reward: {checkpoint} does not fit {med_config}: {detail}") from None
    words = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    for special in _BLIP_SPECIAL_TOKENS:
        words.add_special_tokens(special)
    if len(words) > text_config.vocab_size:
        raise ValueError(f"image_reward: the tokenizer {tokenizer} has {len(words)} tokens with BLIP's [DEC] and "
                         f"[ENC], the text encoder of {checkpoint} {text_config.vocab_size}")
    vision, text, mlp = (module.to(device).eval() for module in parts.values())
    return _ImageRewardNet(vision, text, mlp, words, _image_reward_transform(vision_config.image_size))


def image_reward_reward(
    images: Sequence[Any], prompts: Sequence[str], *, model: str = IMAGE_REWARD_HUB_ID,
    tokenizer: str = IMAGE_REWARD_TOKENIZER, med_config: str | None = None, device: str = "cpu",
    batch_size: int = 16, **metadata: Any,
) -> list[float]:
    """ImageReward (Xu et al. 2023) as the image-reward package scores it (ImageReward/ImageReward.py,
    ``ImageReward.score``; flow_grpo/imagereward_scorer.py calls its ``inference_rank``, the same values):
    (MLP(h) - 0.16717) / 1.03334, h the [CLS] state of BLIP's text encoder over the prompt with
    cross-attention to the image's ViT states.

    The image-reward package (1.5) does not import under transformers 5 (its BLIP text
    model uses helpers transformers removed) and pins timm 0.6.13; the same network is
    built here from transformers' BLIP. ``model`` (a path, or a hub id in the local cache)
    is either

    - the published checkpoint: ``ImageReward.pt`` (THUDM/ImageReward; a torch state dict
      loaded tensors-only, in BLIP's own layout, converted by
      :func:`convert_image_reward_state_dict`) or a directory holding it, with
      ``med_config.json`` beside it (or at ``med_config``); the tokenizer is ``tokenizer``
      (bert-base-uncased) with BLIP's ``[DEC]`` and ``[ENC]`` added, as ImageReward's
      ``init_tokenizer`` does; or
    - a directory holding a ``BlipForImageTextRetrieval`` checkpoint (its ``vision_model``
      and ``text_encoder``; BLIP ViT-L needs ``layer_norm_eps=1e-6`` in its vision config),
      the BERT tokenizer, and ``image_reward_mlp.safetensors`` (the MLP, keys
      ``layers.N.*``; see :func:`preference_mlp`).

    Images are preprocessed by ImageReward's ``_transform`` (torchvision: the shorter side
    resized to the vision model's image size, bicubic, centre crop, CLIP's normalisation),
    not by BLIP's image processor; prompts are padded and truncated to 35 tokens.
    ImageReward scores one image per forward pass; here ``batch_size`` images at once (the
    same values).
    """
    _check_batch("image_reward", images, prompts, batch_size)
    if not images:
        return []
    import torch

    path = resolve_weights(model, reward="image_reward")
    checkpoint = path if path.is_file() else path / IMAGE_REWARD_CHECKPOINT
    if checkpoint.is_file():
        config_path = resolve_weights(med_config or str(checkpoint.parent / IMAGE_REWARD_MED_CONFIG),
                                      reward="image_reward", option="med_config")
        tokenizer_path = resolve_weights(tokenizer, reward="image_reward", option="tokenizer")
        key: tuple = ("image_reward", str(checkpoint), str(config_path), str(tokenizer_path), device)
        load = functools.partial(_load_image_reward_published, checkpoint, config_path, tokenizer_path, device)
    else:
        head = path / IMAGE_REWARD_HEAD_FILE
        if not head.is_file():
            raise FileNotFoundError(
                f"image_reward: {path} holds neither {IMAGE_REWARD_CHECKPOINT} (the published checkpoint) nor "
                f"{IMAGE_REWARD_HEAD_FILE} (ImageReward's MLP beside a transformers BLIP); {_needs(None)}")
        key = ("image_reward", str(path), device)
        load = functools.partial(_load_image_reward_transformers, path, head, device)

    net = cached_model(key, load)
    scores: list[float] = []
    with torch.no_grad():
        for rows in _chunks(len(images), batch_size):
            pixels = torch.stack([net.preprocess(image.convert("RGB")) for image in images[rows]]).to(device)
            image_states = net.vision(pixel_values=pixels).last_hidden_state
            text = net.tokenizer(list(prompts[rows]), padding="max_length", truncation=True,
                                 max_length=IMAGE_REWARD_MAX_TOKENS, return_tensors="pt")
            states = net.text(
                input_ids=text["input_ids"].to(device), attention_mask=text["attention_mask"].to(device),
                encoder_hidden_states=image_states,
                encoder_attention_mask=torch.ones(image_states.shape[:-1], dtype=torch.long, device=device),
            ).last_hidden_state
            rewards = (net.mlp(states[:, 0, :].float()).squeeze(1) - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD
            scores.extend(rewards.cpu().tolist())
    return scores
