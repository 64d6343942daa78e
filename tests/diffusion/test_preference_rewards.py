"""The preference-model image rewards (grouprl.domains.diffusion.preference_rewards) on tiny random models of
the published architectures, built offline from configs, saved, and loaded back through the rewards' own
loading path: the score shape, batching, the formula recomputed here from the models' outputs, missing weights.

What cannot be checked here: the published scores on the published weights (docs/flow-grpo.md).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from PIL import Image

from grouprl.domains.diffusion import preference_rewards as pr
from grouprl.domains.diffusion.rewards import score_images
from grouprl.rewards import RewardError

PROMPTS = ["a red square on the left", "a blue circle", "two green squares", "a red square on the right",
           "a yellow triangle"]
# Scores from batches of 1 and of 4 agree to float32 rounding, not bit for bit (different matmul blocking).
TOL = dict(rel=1e-4, abs=1e-5)


def sensitive_mlp(input_size, seed):
    """The published MLP layout with weights of unit gain (PyTorch's default init shrinks the output to nearly a
    constant, which would hide a wrong input)."""
    torch.manual_seed(seed)
    mlp = pr.preference_mlp(input_size)
    for layer in mlp.layers:
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=layer.in_features ** -0.5)
            torch.nn.init.normal_(layer.bias, std=0.1)
    return mlp.eval()


def images(n=5, size=(24, 24)):
    """Distinct random RGB images (seeded), some not square to exercise the resizing."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        w, h = size if i % 2 == 0 else (size[0] + 8, size[1])
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        out.append(Image.fromarray(pixels, "RGB"))
    return out


@pytest.fixture(autouse=True)
def fresh_cache():
    pr.clear_model_cache()
    yield
    pr.clear_model_cache()


def tiny_clip_config(tokenizer, projection_dim=16):
    from transformers import CLIPConfig

    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=77, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=8)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim, logit_scale_init_value=2.0)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A tiny random transformers CLIP with its processor, saved as PickScore / CLIP ViT-L are."""
    from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor

    from grouprl.domains.diffusion.tiny import build_clip_tokenizer

    root = tmp_path_factory.mktemp("tiny_clip")
    tokenizer = build_clip_tokenizer(PROMPTS)
    torch.manual_seed(0)
    model = CLIPModel(tiny_clip_config(tokenizer)).eval()
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 16},
                                                                 crop_size={"height": 16, "width": 16}),
                              tokenizer=tokenizer)
    model.save_pretrained(root)
    processor.save_pretrained(root)
    return root


def clip_logits_here(root, imgs, prompts):
    """exp(logit_scale) * cos from CLIP's own forward (logits_per_image), checked against the embeddings."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(root).eval(), CLIPProcessor.from_pretrained(root)
    inputs = processor(text=prompts, images=imgs, padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    by_hand = model.logit_scale.exp() * (out.image_embeds * out.text_embeds).sum(-1)  # embeds are unit vectors
    assert torch.allclose(out.logits_per_image.diagonal(), by_hand, atol=1e-5)
    return out.logits_per_image.diagonal().tolist()


@pytest.mark.parametrize("name, divisor", [("pickscore", 26.0), ("clip_score", 30.0)])
def test_clip_rewards_are_the_scaled_logits(tiny_clip, name, divisor):
    imgs = images()
    kwargs = {"model": str(tiny_clip), "processor": None}
    one = score_images([{"name": name, "kwargs": {**kwargs, "batch_size": 1}}], imgs, PROMPTS).components[name]
    four = score_images([{"name": name, "kwargs": {**kwargs, "batch_size": 4}}], imgs, PROMPTS).components[name]
    assert len(one) == 5 and one == pytest.approx(four, **TOL)
    expected = [x / divisor for x in clip_logits_here(tiny_clip, imgs, PROMPTS)]
    assert one == pytest.approx(expected, **TOL)
    assert len(set(round(x, 6) for x in one)) == 5  # rows are scored on their own image and prompt


def test_a_model_is_loaded_once_per_weights_and_device(tiny_clip, monkeypatch):
    from transformers import CLIPModel

    loads = []
    real = CLIPModel.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        loads.append(args[0])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(CLIPModel, "from_pretrained", classmethod(counting))
    for _ in range(3):
        pr.pickscore_reward(images(2), PROMPTS[:2], model=str(tiny_clip), processor=None)
    assert len(loads) == 1
    pr.clip_score_reward(images(2), PROMPTS[:2], model=str(tiny_clip))
    assert len(loads) == 2  # another reward: its own entry


def test_aesthetic_is_the_mlp_of_the_normalised_image_embedding(tiny_clip, tmp_path):
    from transformers import CLIPModel, CLIPProcessor

    mlp = sensitive_mlp(16, seed=1)
    head = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(mlp.state_dict(), head)  # the published file: a plain torch state dict
    assert sorted(mlp.state_dict()) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    imgs = images()
    kwargs = {"model": str(tiny_clip), "head": str(head)}
    one = score_images([{"name": "aesthetic", "kwargs": {**kwargs, "batch_size": 1}}], imgs, PROMPTS)
    four = pr.aesthetic_reward(imgs, PROMPTS, batch_size=4, **kwargs)
    assert one.components["aesthetic"] == pytest.approx(four, **TOL)

    model, processor = CLIPModel.from_pretrained(tiny_clip).eval(), CLIPProcessor.from_pretrained(tiny_clip)
    with torch.no_grad():
        embeds = model(**processor(text=PROMPTS, images=imgs, padding=True, return_tensors="pt")).image_embeds
        expected = mlp.eval()(embeds / embeds.norm(dim=-1, keepdim=True)).squeeze(1).tolist()
    assert four == pytest.approx(expected, **TOL)

    wrong = tmp_path / "wrong.pth"
    torch.save(pr.preference_mlp(8).state_dict(), wrong)
    with pytest.raises(ValueError, match="takes 8-d embeddings.*gives 16-d"):
        pr.aesthetic_reward(imgs, PROMPTS, model=str(tiny_clip), head=str(wrong))


# ---------------------------------------------------------------------------- HPSv2 (open_clip)

TINY_OPEN_CLIP = {"embed_dim": 16,
                  "vision_cfg": {"image_size": 16, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
                  "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    """A tiny random open_clip model saved as HPSv2's checkpoint ({'state_dict': ...}), and its config JSON."""
    open_clip = pytest.importorskip("open_clip")
    root = tmp_path_factory.mktemp("tiny_hps")
    config = root / "grouprl-tiny-hps.json"
    config.write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(str(config))
    torch.manual_seed(2)
    model = open_clip.create_model("grouprl-tiny-hps", pretrained=None, output_dict=True)  # as HPSv2 builds it
    torch.save({"state_dict": model.state_dict()}, root / "HPS_v2.1_compressed.pt")
    return root / "HPS_v2.1_compressed.pt", config, model.eval()


def hps_pixels(image, size=16):
    """HPSv2's evaluation transform by hand: the longer side to ``size`` (bicubic), centred on black, CLIP's
    normalisation."""
    import numpy as np

    scale = size / max(image.size)
    w, h = round(image.size[0] * scale), round(image.size[1] * scale)
    canvas = Image.new("RGB", (size, size), (0, 0, 0))
    canvas.paste(image.resize((w, h), Image.BICUBIC), ((size - w) // 2, (size - h) // 2))
    x = torch.from_numpy(np.asarray(canvas, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    return (x - mean) / std


def test_hpsv2_is_the_cosine_of_open_clips_features(tiny_hps):
    import open_clip

    checkpoint, config, model = tiny_hps
    imgs = images()
    kwargs = {"model": str(checkpoint), "arch": str(config)}
    one = score_images([{"name": "hpsv2", "kwargs": {**kwargs, "batch_size": 1}}], imgs, PROMPTS).components["hpsv2"]
    four = pr.hpsv2_reward(imgs, PROMPTS, batch_size=4, **kwargs)
    assert len(one) == 5 and one == pytest.approx(four, **TOL)
    tokens = open_clip.get_tokenizer("grouprl-tiny-hps")(PROMPTS)
    with torch.no_grad():
        out = model(torch.stack([hps_pixels(image) for image in imgs]), tokens)  # HPSv2's call: output dict
        expected = torch.diagonal(out["image_features"] @ out["text_features"].T).tolist()
    assert one == pytest.approx(expected, rel=1e-3, abs=1e-4)  # PIL vs torchvision resampling: last digits
    assert all(-1.0 <= x <= 1.0 for x in one)


def test_hpsv2_without_open_clip_names_the_extra(tiny_hps, monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip", None)
    with pytest.raises(ImportError, match=r"'hpsv2' image reward needs open_clip: pip install 'grouprl\[preference\]'"):
        pr.hpsv2_reward(images(1), PROMPTS[:1], model=str(tiny_hps[0]), arch=str(tiny_hps[1]))


# ---------------------------------------------------------------------------- ImageReward (transformers BLIP)


@pytest.fixture(scope="module")
def tiny_image_reward(tmp_path_factory):
    """A tiny random BLIP (retrieval: ViT + BERT text encoder with cross-attention), a BERT tokenizer built
    from a word list, and ImageReward's MLP, saved in the directory layout image_reward loads."""
    from safetensors.torch import save_file
    from transformers import BertTokenizer, BlipConfig, BlipForImageTextRetrieval

    root = tmp_path_factory.mktemp("tiny_image_reward")
    words = sorted({w for p in PROMPTS for w in p.split()})
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = BertTokenizer(str(root / "vocab.txt"))
    config = BlipConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, encoder_hidden_size=24, max_position_embeddings=64,
                         pad_token_id=0, initializer_range=0.5),
        vision_config=dict(hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8, layer_norm_eps=1e-6, initializer_range=0.5),
        projection_dim=16, image_text_hidden_size=16)  # initializer_range 0.5: scores far apart, not near a constant
    torch.manual_seed(3)
    model = BlipForImageTextRetrieval(config).eval()
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    mlp = sensitive_mlp(16, seed=4)
    save_file({k: v.contiguous() for k, v in mlp.state_dict().items()}, root / pr.IMAGE_REWARD_HEAD_FILE)
    return root, model, tokenizer, mlp


def image_reward_pixels(image, size=16):
    """ImageReward's _transform by hand: shorter side to ``size`` (bicubic), centre crop, CLIP normalisation."""
    from torchvision import transforms as T

    return T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size), T.ToTensor(),
                      T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])(image)


def test_image_reward_is_the_normalised_mlp_of_the_cross_attended_cls_state(tiny_image_reward):
    root, model, tokenizer, mlp = tiny_image_reward
    imgs = images()
    prompts = [*PROMPTS[:4], " ".join(PROMPTS * 3)]  # the last is longer than ImageReward's 35 tokens: truncated
    one = score_images([{"name": "image_reward", "kwargs": {"model": str(root), "batch_size": 1}}], imgs,
                       prompts).components["image_reward"]
    four = pr.image_reward_reward(imgs, prompts, model=str(root), batch_size=4)
    assert len(one) == 5 and one == pytest.approx(four, **TOL)
    text = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    with torch.no_grad():  # BLIP's image-text matching pass keeps the text encoder's states (question_embeds)
        out = model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], use_itm_head=True,
                    pixel_values=torch.stack([image_reward_pixels(image) for image in imgs]))
        raw = mlp(out.question_embeds[:, 0, :]).squeeze(1)
    expected = ((raw - 0.16717362830052426) / 1.0333394966054072).tolist()
    assert one == pytest.approx(expected, **TOL)


def test_image_reward_directory_without_the_head(tiny_image_reward, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=rf"image_reward: {re.escape(str(tmp_path))} holds neither ImageReward.pt "
                                                r"\(the published checkpoint\) nor image_reward_mlp.safetensors"):
        pr.image_reward_reward(images(1), PROMPTS[:1], model=str(tmp_path))


# ---------------------------------------------------------------------------- ImageReward's published checkpoint

VIT_DEPTH, TEXT_DEPTH = 2, 2


def scramble(module, seed):
    """Every tensor random and distinct (LayerNorm gains around 1, the rest of unit gain), so that a tensor loaded
    into the wrong place -- even one of the same shape, norm1 for norm2 -- changes the scores."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(noise * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.3))
    return module


def image_reward_original_layout(model, mlp):
    """The tiny transformers BLIP's tensors under the names ImageReward's own modules give them, written here
    from the original code (THUDM/ImageReward, ImageReward/models/BLIP): ImageReward.blip is BLIP_Pretrain
    (blip_pretrain.py: visual_encoder, text_encoder, vision_proj, text_proj), its visual_encoder vit.py's
    VisionTransformer (patch_embed.proj, cls_token, pos_embed, blocks.N.{norm1, attn.qkv, attn.proj, norm2,
    mlp.fc1, mlp.fc2}, norm; Attention.qkv is ONE Linear(dim, 3 * dim) read as (3, heads, head_dim), as
    transformers' BlipAttention.qkv is: copied whole), its text_encoder med.py's BertModel(add_pooling_layer=False)
    (no token_type_embeddings; position_ids a persistent buffer); ImageReward.mlp the MLP (layers.0 ... layers.7)."""
    hf = model.state_dict()
    used, out = set(), {}

    def put(original, name):
        used.add(name)
        out[original] = hf[name]

    for p in ("weight", "bias"):
        put(f"blip.visual_encoder.patch_embed.proj.{p}", f"vision_model.embeddings.patch_embedding.{p}")
        put(f"blip.visual_encoder.norm.{p}", f"vision_model.post_layernorm.{p}")
        put(f"blip.vision_proj.{p}", f"vision_proj.{p}")
        put(f"blip.text_proj.{p}", f"text_proj.{p}")
        put(f"blip.text_encoder.embeddings.LayerNorm.{p}", f"text_encoder.embeddings.LayerNorm.{p}")
        for i in range(VIT_DEPTH):
            for original, name in [("norm1", "layer_norm1"), ("attn.qkv", "self_attn.qkv"),
                                   ("attn.proj", "self_attn.projection"), ("norm2", "layer_norm2"),
                                   ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")]:
                put(f"blip.visual_encoder.blocks.{i}.{original}.{p}", f"vision_model.encoder.layers.{i}.{name}.{p}")
        for i in range(TEXT_DEPTH):
            for part in ("attention.self.query", "attention.self.key", "attention.self.value",
                         "attention.output.dense", "attention.output.LayerNorm", "crossattention.self.query",
                         "crossattention.self.key", "crossattention.self.value", "crossattention.output.dense",
                         "crossattention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm"):
                put(f"blip.text_encoder.encoder.layer.{i}.{part}.{p}", f"text_encoder.encoder.layer.{i}.{part}.{p}")
        for j in (0, 2, 4, 6, 7):
            out[f"mlp.layers.{j}.{p}"] = mlp.state_dict()[f"layers.{j}.{p}"]
    put("blip.visual_encoder.cls_token", "vision_model.embeddings.class_embedding")
    put("blip.visual_encoder.pos_embed", "vision_model.embeddings.position_embedding")
    for name in ("word_embeddings", "position_embeddings"):
        put(f"blip.text_encoder.embeddings.{name}.weight", f"text_encoder.embeddings.{name}.weight")
    out["blip.text_encoder.embeddings.position_ids"] = torch.arange(64).expand((1, -1))
    assert used == set(hf) - {"itm_head.weight", "itm_head.bias"}  # every tensor of the towers has its original
    assert len(out) == 6 + 12 * VIT_DEPTH + 4 + 1 + 26 * TEXT_DEPTH + 4 + 10
    return out


TINY_MED_CONFIG = {  # med_config.json's fields at the tiny sizes; encoder_width wrong as in the published file
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 16, "initializer_range": 0.02, "intermediate_size": 32,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 64, "model_type": "bert", "num_attention_heads": 2,
    "num_hidden_layers": TEXT_DEPTH, "pad_token_id": 0, "type_vocab_size": 2, "encoder_width": 768,
    "add_cross_attention": True}


@pytest.fixture(scope="module")
def published_image_reward(tmp_path_factory):
    """A tiny random BLIP (ViT 128 wide: two of BLIP's 64-wide heads) and ImageReward MLP, saved as the published
    THUDM/ImageReward is (ImageReward.pt in the original layout, med_config.json), and a BERT tokenizer."""
    from transformers import BertTokenizer, BlipConfig, BlipForImageTextRetrieval

    root = tmp_path_factory.mktemp("published_image_reward")
    words = sorted({w for p in PROMPTS for w in p.split()})
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(root / "bert")
    vocab = len(words) + 5 + 2  # + BLIP's [DEC] and [ENC], as the published 30524 = 30522 + 2
    config = BlipConfig(
        text_config=dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=TEXT_DEPTH,
                         num_attention_heads=2, encoder_hidden_size=128, max_position_embeddings=64, pad_token_id=0),
        vision_config=dict(hidden_size=128, intermediate_size=32, num_hidden_layers=VIT_DEPTH, num_attention_heads=2,
                           image_size=16, patch_size=8, layer_norm_eps=1e-6),
        projection_dim=16, image_text_hidden_size=16)
    model = scramble(BlipForImageTextRetrieval(config), seed=5).eval()
    mlp = sensitive_mlp(16, seed=6)
    (root / "published").mkdir()
    torch.save(image_reward_original_layout(model, mlp), root / "published" / "ImageReward.pt")
    (root / "published" / "med_config.json").write_text(json.dumps({**TINY_MED_CONFIG, "vocab_size": vocab}))
    return root, model, mlp


def direct_image_reward(model, mlp, tokenizer_dir, imgs, prompts):
    """The formula on the transformers model itself (BLIP's image-text matching pass keeps the text encoder's
    states), the tokenizer with BLIP's [DEC] and [ENC] added as ImageReward's init_tokenizer does."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    text = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], use_itm_head=True,
                    pixel_values=torch.stack([image_reward_pixels(image) for image in imgs]))
        raw = mlp(out.question_embeds[:, 0, :]).squeeze(1)
    return ((raw - 0.16717362830052426) / 1.0333394966054072).tolist()


def test_the_published_image_reward_checkpoint_scores_as_the_model_it_was_written_from(published_image_reward):
    root, model, mlp = published_image_reward
    imgs = images()
    # "[ENC]" is one token only with BLIP's special tokens added; the last prompt is truncated to 35 tokens
    prompts = [*PROMPTS[:3], "a blue [ENC] circle", " ".join(PROMPTS * 3)]
    kwargs = {"model": str(root / "published"), "tokenizer": str(root / "bert"), "batch_size": 2}
    scores = score_images([{"name": "image_reward", "kwargs": kwargs}], imgs, prompts).components["image_reward"]
    expected = direct_image_reward(model, mlp, root / "bert", imgs, prompts)
    assert scores == pytest.approx(expected, **TOL)
    assert len(set(round(x, 4) for x in scores)) == 5
    pr.clear_model_cache()  # the file itself, med_config.json found beside it
    assert pr.image_reward_reward(imgs, prompts, **{**kwargs, "model": str(root / "published" / "ImageReward.pt")}) \
        == pytest.approx(expected, **TOL)


def test_the_default_image_reward_is_the_hub_id_in_the_local_cache(published_image_reward, tmp_path, monkeypatch):
    import huggingface_hub.constants

    root, model, mlp = published_image_reward
    repo = tmp_path / "hub" / "models--THUDM--ImageReward"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / ("0" * 40)).symlink_to(root / "published", target_is_directory=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    scores = pr.image_reward_reward(images(2), PROMPTS[:2], tokenizer=str(root / "bert"))
    assert scores == pytest.approx(direct_image_reward(model, mlp, root / "bert", images(2), PROMPTS[:2]), **TOL)


@pytest.mark.parametrize("edit, message", [
    ({"add": "blip.itm_head.weight"}, r"unexpected keys, not in ImageReward's layout: blip\.itm_head\.weight"),
    ({"add": "blip.text_encoder.encoder.layer.2.output.dense.bias"},  # a layer med_config.json does not have
     r"unexpected keys blip\.text_encoder\.encoder\.layer\.2\.output\.dense\.bias"),
    ({"drop": "blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"},
     r"missing keys blip\.text_encoder\.encoder\.layer\.1\.crossattention\.self\.key\.weight"),
    ({"drop": "blip.visual_encoder.blocks.0.attn.qkv.bias"}, r"missing keys blip\.visual_encoder\.blocks\.0\.attn\.qkv\.bias"),
    ({"drop": "blip.visual_encoder.cls_token"}, r"missing key blip\.visual_encoder\.cls_token"),
])
def test_a_published_image_reward_checkpoint_with_a_wrong_key_names_it(published_image_reward, tmp_path, edit, message):
    root, _, _ = published_image_reward
    state = torch.load(root / "published" / "ImageReward.pt", weights_only=True)
    if "add" in edit:
        state[edit["add"]] = torch.zeros(2)
    else:
        del state[edit["drop"]]
    torch.save(state, tmp_path / "ImageReward.pt")
    (tmp_path / "med_config.json").write_text((root / "published" / "med_config.json").read_text())
    with pytest.raises(ValueError, match=rf"image_reward: {re.escape(str(tmp_path / 'ImageReward.pt'))}\b.*{message}"):
        pr.image_reward_reward(images(1), PROMPTS[:1], model=str(tmp_path), tokenizer=str(root / "bert"))


def test_a_published_image_reward_checkpoint_without_med_config_names_it(published_image_reward, tmp_path):
    root, _, _ = published_image_reward
    (tmp_path / "ImageReward.pt").symlink_to(root / "published" / "ImageReward.pt")
    with pytest.raises(FileNotFoundError, match=rf"image_reward: med_config '{re.escape(str(tmp_path))}/med_config.json' "
                                                r"is neither an existing path"):
        pr.image_reward_reward(images(1), PROMPTS[:1], model=str(tmp_path), tokenizer=str(root / "bert"))


# ---------------------------------------------------------------------------- missing weights, bad options


@pytest.mark.parametrize("name, kwargs, extra", [
    ("pickscore", {}, r"\(no extra needed\)"),
    ("clip_score", {}, r"\(no extra needed\)"),
    ("aesthetic", {"head": "/nowhere/head.pth"}, r"\(no extra needed\)"),
    ("image_reward", {}, r"\(no extra needed\)"),
    ("hpsv2", {}, r"pip install 'grouprl\[preference\]'"),
])
def test_missing_weights_name_the_path_and_the_extra(name, kwargs, extra, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # a hub id is looked up in an empty cache
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match=rf"{name}: model '{re.escape(missing)}' is neither .*; .*{extra}"):
        getattr(pr, f"{name}_reward" if name != "image_reward" else "image_reward_reward")(
            images(1), PROMPTS[:1], model=missing, **kwargs)
    with pytest.raises(RewardError, match=rf"{name}: model '[^']+/[^']+'.* is neither an existing path nor a hub id in "
                                          r"the local Hugging Face cache"):  # the default: the published hub id
        score_images([{"name": name, "kwargs": kwargs}], images(1), PROMPTS[:1])


def test_batch_size_and_row_count_are_checked(tiny_clip):
    with pytest.raises(ValueError, match="pickscore: batch_size must be a positive integer, got 0"):
        pr.pickscore_reward(images(1), PROMPTS[:1], model=str(tiny_clip), batch_size=0)
    with pytest.raises(ValueError, match="clip_score: got 2 prompts for 1 images"):
        pr.clip_score_reward(images(1), PROMPTS[:2], model=str(tiny_clip))
    assert pr.clip_score_reward([], [], model="/never/loaded") == []
