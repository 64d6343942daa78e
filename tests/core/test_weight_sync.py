"""Weight sync into an engine that loads the checkpoint's names: names, tied weights, wrappers, LoRA, FSDP2."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grouprl.models.loading import apply_lora, load_model_and_processor
from grouprl.models.tiny import build_tiny_text_lm, build_tiny_vlm
from grouprl.models.weight_sync import checkpoint_names, gathered_named_parameters, named_weights_for_sync

CORPUS = [
    "Heart size is normal. No pleural effusion or pneumothorax.",
    "Mild cardiomegaly. Small left pleural effusion.",
] * 4


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_sync_models")
    return {"vlm": build_tiny_vlm(root / "vlm", CORPUS, seed=3), "lm": build_tiny_text_lm(root / "lm", CORPUS, seed=3)}


def saved(path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


class Wrapper(torch.nn.Module):  # what DDP / accelerate put around the policy
    def __init__(self, module):
        super().__init__()
        self.module = module


def with_lora(model, seed=0):
    """A LoRA policy whose adapters change the weights (B is zero at init)."""
    policy = apply_lora(model, rank=4, alpha=8)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return policy


@pytest.mark.parametrize("which", ["vlm", "lm"])
def test_checkpoint_names_point_at_the_saved_tensors(paths, which):
    model, _, _ = load_model_and_processor(paths[which])
    on_disk = saved(paths[which])
    names = checkpoint_names(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(names) == set(params)
    for name, param in params.items():
        assert names[name] in on_disk, name
        assert torch.equal(on_disk[names[name]], param.detach()), name
    assert set(names.values()) == set(on_disk)  # every saved tensor is reached
    # the tied head is the embeddings' tensor, saved once under the embeddings' name
    assert names["lm_head.weight"] == "model.embed_tokens.weight"
    if which == "vlm":  # transformers 5 renames on load; the checkpoint keeps the old names
        assert names["model.language_model.embed_tokens.weight"] == "model.embed_tokens.weight"
        assert names["model.visual.patch_embed.proj.weight"] == "visual.patch_embed.proj.weight"


def test_a_head_untied_at_run_time_keeps_its_own_name(paths, tmp_path):
    model, _, _ = load_model_and_processor(paths["lm"])
    head = model.get_output_embeddings()
    untied = torch.nn.Linear(head.in_features, head.out_features, bias=False)
    with torch.no_grad():
        untied.weight.copy_(head.weight * 2)
    model.set_output_embeddings(untied)
    names = checkpoint_names(model)
    assert names["lm_head.weight"] == "lm_head.weight"
    model.save_pretrained(tmp_path)
    on_disk = saved(tmp_path)
    for name, param in model.named_parameters():
        assert torch.equal(on_disk[names[name]], param.detach()), name


@pytest.mark.parametrize("which", ["vlm", "lm"])
def test_sync_yields_each_saved_tensor_once_plain_and_wrapped(paths, which):
    model, _, _ = load_model_and_processor(paths[which])
    on_disk = saved(paths[which])
    for policy in (model, Wrapper(model)):
        out = list(named_weights_for_sync(policy))
        names = [n for n, _ in out]
        assert len(names) == len(set(names)) and set(names) == set(on_disk)
        for name, tensor in out:
            assert torch.equal(tensor, on_disk[name]), name
    # an already gathered stream (the trainer's full_named_parameters) gives the same pairs
    given = list(named_weights_for_sync(Wrapper(model), gathered_named_parameters(Wrapper(model))))
    assert [n for n, _ in given] == [n for n, _ in named_weights_for_sync(model)]


def test_unknown_names_are_refused(paths):
    model, _, _ = load_model_and_processor(paths["lm"])
    with pytest.raises(KeyError, match="not a parameter"):
        list(named_weights_for_sync(model, [("module.model.norm.weight", torch.zeros(1))]))


@pytest.mark.parametrize("which", ["vlm", "lm"])
def test_lora_is_merged_out_of_place(paths, which):
    model, _, _ = load_model_and_processor(paths[which])
    on_disk_names = set(saved(paths[which]))
    policy = with_lora(model)
    policy.train()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    ids = torch.randint(10, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_before = policy(input_ids=ids).logits.clone()

    out = list(named_weights_for_sync(policy))

    # what peft's own merge gives, on a copy
    merged = copy.deepcopy(policy).merge_and_unload()
    reference = {checkpoint_names(merged)[n]: p.detach() for n, p in merged.named_parameters()}
    names = [n for n, _ in out]
    assert len(names) == len(set(names))
    assert set(names) == set(reference) == on_disk_names  # the base model's checkpoint names
    assert not any("lora" in n or "base_layer" in n or n.startswith("base_model") for n in names)
    changed = 0
    for name, tensor in out:
        assert tensor.dtype == reference[name].dtype
        torch.testing.assert_close(tensor, reference[name], rtol=1e-5, atol=1e-6)
        changed += not torch.equal(tensor, saved(paths[which])[name])
    assert changed >= 4  # the adapters really moved the adapted layers' weights

    # the policy was never merged: same parameters and outputs, bit for bit, still training
    after = dict(policy.named_parameters())
    assert set(after) == set(before)
    for n, p in after.items():
        assert torch.equal(p.detach(), before[n]), n
    assert not any(getattr(m, "merged", False) for m in policy.modules())
    with torch.no_grad():
        assert torch.equal(policy(input_ids=ids).logits, logits_before)
    assert policy.training


def test_lora_with_adapters_disabled_or_abandoned_stream(paths):
    model, _, _ = load_model_and_processor(paths["lm"])
    on_disk = saved(paths["lm"])
    policy = with_lora(model)
    stream = named_weights_for_sync(policy)
    next(stream)
    stream.close()  # a consumer that stops early leaves nothing merged: there is nothing to undo
    assert not any(getattr(m, "merged", False) for m in policy.modules())
    with policy.disable_adapter():  # adapters off: the forward uses the base weights, so does the sync
        for name, tensor in named_weights_for_sync(policy):
            assert torch.equal(tensor, on_disk[name]), name


_TWO_PROCESS_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from grouprl.models.loading import apply_lora, load_model_and_processor
    from grouprl.models.weight_sync import named_weights_for_sync
    from grouprl.trainer.parallel import full_named_parameters, shard_fsdp
    from grouprl.trainer.precision import precision_policy

    def lora(model):
        policy = apply_lora(model, rank=4, alpha=8)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        return policy

    def load(path, use_lora):
        model, _, _ = load_model_and_processor(path)
        return lora(model) if use_lora else model

    path, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"world": dist.get_world_size()}
    for use_lora in (False, True):
        expected = dict(named_weights_for_sync(load(path, use_lora)))
        ddp = DistributedDataParallel(load(path, use_lora))
        sharded = shard_fsdp(load(path, use_lora), precision_policy("float32"), torch.device("cpu"))
        local = next(iter(sharded.parameters()))
        cases = {
            "ddp": dict(named_weights_for_sync(ddp)),
            "fsdp": dict(named_weights_for_sync(sharded)),
            "fsdp_gathered_by_trainer": dict(named_weights_for_sync(sharded, full_named_parameters(sharded))),
        }
        for case, got in cases.items():
            result[f"{case}_lora{use_lora}"] = {
                "same_names": sorted(got) == sorted(expected),
                "max_diff": max(float((got[n] - expected[n]).abs().max()) for n in expected),
            }
        result[f"sharded_lora{use_lora}"] = local.to_local().numel() < local.numel()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
''')


def test_ddp_and_fsdp2_on_two_processes(paths, tmp_path):
    script = tmp_path / "sync_check.py"
    script.write_text(_TWO_PROCESS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(paths["lm"]), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["world"] == 2
        for key, value in result.items():
            if key.startswith("sharded"):
                assert value, key  # the policy really was sharded
            elif key != "world":
                assert value["same_names"], key
                assert value["max_diff"] <= 1e-6, (key, value)
