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
    with pytest.raises(FileNotFoundError, match=rf"image_reward: {tmp_path} has no image_reward_mlp.safetensors"):
        pr.image_reward_reward(images(1), PROMPTS[:1], model=str(tmp_path))


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
    if name == "image_reward":
        return  # no default hub id: the published weights are not in transformers' layout
    with pytest.raises(RewardError, match=rf"{name}: model '[^']+/[^']+'.* is neither an existing path nor a hub id in "
                                          r"the local Hugging Face cache"):  # the default: the published hub id
        score_images([{"name": name, "kwargs": kwargs}], images(1), PROMPTS[:1])


def test_batch_size_and_row_count_are_checked(tiny_clip):
    with pytest.raises(ValueError, match="pickscore: batch_size must be a positive integer, got 0"):
        pr.pickscore_reward(images(1), PROMPTS[:1], model=str(tiny_clip), batch_size=0)
    with pytest.raises(ValueError, match="clip_score: got 2 prompts for 1 images"):
        pr.clip_score_reward(images(1), PROMPTS[:2], model=str(tiny_clip))
    assert pr.clip_score_reward([], [], model="/never/loaded") == []
