"""How the trained policy is spread over processes: DDP through Accelerate, or FSDP2.

``ddp``: every process holds the whole model; Accelerate wraps it in
DistributedDataParallel, which averages gradients in the backward of the last
micro-batch of a mini-batch.

``fsdp``: parameters, gradients and optimizer state are sharded over the processes
with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), one unit per decoder
layer / vision block (the model's ``_no_split_modules``) and one for the rest.
Accelerate's own FSDP plugin only engages on accelerators (its CPU state is always
``MULTI_CPU``, i.e. DDP), so grouprl applies FSDP2 itself; the same code then runs
on CPU processes (gloo) and GPUs (NCCL). Every forward and backward of a sharded
model is a collective: each process must run the same number of them, which the
trainer guarantees by giving every process the same number of rows, and by
sampling from a separate, unsharded rollout copy of the weights.

Hangs. Every process waits in each collective for all the others, so one stuck or
frozen process stops the job. :func:`make_accelerator` gives the process group
``trainer.distributed_timeout``: a collective waiting longer fails, and :func:`stage`,
which the run loop and the trainers wrap around their stages (:func:`mark` names the
part of a stage under way), turns torch's transport-level error into
:class:`CollectiveFailure` naming this process, where it was (``step 3, train >
update``) and where every other process last said it was (``rank 1 was last at step
3, train > reward``: the stuck one is usually the one elsewhere). The failing process exits, and the launcher (torchrun, accelerate) ends
the rest. On several nodes each process is named with its node as well (:func:`node_label`:
``rank 1 (node 1 of 2, host gpu-b)``), so that the message says which machine to look at.

Nodes. torchrun (and ``accelerate launch``, which runs it) starts one launcher per node and tells
each worker its node's rank (``GROUP_RANK``) and the number of nodes (``GROUP_WORLD_SIZE``);
:func:`this_process` reads them with the hostname, and :func:`process_layout` gathers every
process's, which run_info.json records under ``processes``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any, Callable, ContextManager, TypeVar

import torch

from grouprl.config import ConfigError, TrainerConfig
from grouprl.trainer.precision import Precision

F = TypeVar("F", bound=Callable[..., Any])


def process_group_backend(device: str, offload: bool) -> str | None:
    """The process group's backends when grouprl must choose them, else None (Accelerate's choice).

    Under FSDP2's CPU offload (``offload``) the gradient shards live in host memory, and clipping
    their norm is a collective on CPU tensors, which NCCL cannot carry (torch: "No backend type
    associated with device type cpu"): on GPUs the group then gets NCCL for GPU tensors and gloo for
    CPU ones, as Accelerate does for its own FSDP offload. ``device``: ``trainer.device`` (on the
    CPU the group is gloo already).
    """
    if offload and device != "cpu" and torch.cuda.is_available():
        return "cuda:nccl,cpu:gloo"
    return None


def make_accelerator(trainer: TrainerConfig, kwargs_handlers: list | None = None, *, offload: bool = False):
    """The run's ``accelerate.Accelerator`` (every trainer makes it here): on the CPU when
    ``trainer.device`` says so, its process group waiting at most ``trainer.distributed_timeout``
    seconds in a collective (see the module docstring), with ``kwargs_handlers`` beside that.
    ``offload``: the policy will be sharded with CPU offload (:func:`process_group_backend`)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    timeout = trainer.distributed_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ConfigError(f"config key 'trainer.distributed_timeout' must be seconds > 0; got {timeout!r}")
    # Only used when this Accelerator starts the process group; one started before keeps its own.
    _TIMEOUT[0] = float(timeout)
    backend = process_group_backend(trainer.device, offload)
    chosen = {"backend": backend} if backend else {}
    group = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout), **chosen)
    handlers = [group, *(kwargs_handlers or [])]
    return Accelerator(cpu=trainer.device == "cpu", kwargs_handlers=handlers)


# ---------------------------------------------------------------------------- nodes


def this_process(rank: int = 0) -> dict:
    """Where this process runs: ``rank`` (given), ``local_rank`` (its place on its node), ``node``
    (torchrun's ``GROUP_RANK``: its node launcher's rank; None when no launcher said), ``num_nodes``
    (``GROUP_WORLD_SIZE``, None likewise) and ``host`` (the hostname)."""

    def number(name: str) -> int | None:
        value = os.environ.get(name, "")
        return int(value) if value.strip().isdigit() else None

    return {"rank": rank, "local_rank": number("LOCAL_RANK"), "node": number("GROUP_RANK"),
            "num_nodes": number("GROUP_WORLD_SIZE"), "host": socket.gethostname()}


def node_label(process: dict) -> str:
    """``node 1 of 2, host gpu-b`` (``host gpu-b`` when no launcher named the node)."""
    if process.get("node") is None:
        return f"host {process['host']}"
    of = f" of {process['num_nodes']}" if process.get("num_nodes") is not None else ""
    return f"node {process['node']}{of}, host {process['host']}"


def process_layout(accelerator) -> list[dict]:
    """:func:`this_process` of every process, in rank order (a collective: every process calls it)."""
    mine = this_process(accelerator.process_index)
    if accelerator.num_processes == 1:
        return [mine]
    from accelerate.utils import gather_object

    return sorted(gather_object([mine]), key=lambda p: p["rank"])


# ---------------------------------------------------------------------------- stages


class CollectiveFailure(RuntimeError):
    """A collective failed (timed out, or a peer vanished) while this process was in ``stage``.

    ``rank``/``world_size``: this process, ``node`` its :func:`node_label`; ``peers``: rank -> the
    stage that process last reported (those that could be read), where the stuck process usually
    shows; ``peer_nodes``: rank -> that process's :func:`node_label` (those that could be read).
    """

    def __init__(self, message: str, *, rank: int, world_size: int, stage: str, peers: dict[int, str],
                 node: str = "", peer_nodes: dict[int, str] | None = None):
        super().__init__(message)
        self.rank, self.world_size, self.stage, self.peers = rank, world_size, stage, peers
        self.node, self.peer_nodes = node, peer_nodes or {}


class _Stages(threading.local):
    """This thread's open stages, innermost last: [name, detail] (``detail`` set by :func:`mark`)."""

    def __init__(self) -> None:
        self.open: list[list[str | None]] = []


_STAGES = _Stages()
_STEP: list[int | None] = [None]  # the training step under way (set by the loop's outermost stage)
_STORE_KEY = "grouprl/stage/{rank}"
_NODE_KEY = "grouprl/node/{rank}"
_NODE_PUBLISHED: list[object] = [None]  # the store this process's node label was published in
_TIMEOUT: list[float | None] = [None]  # trainer.distributed_timeout of this process's Accelerator, for messages


def current_stage() -> str:
    """What this thread is doing, e.g. ``train > reward`` ("" outside any stage)."""
    return " > ".join(name if detail is None else f"{name} > {detail}" for name, detail in _STAGES.open)


def _where() -> str:
    """The current stage with the training step, e.g. ``step 3, train > reward``."""
    here = current_stage() or "(between stages)"
    return here if _STEP[0] is None else f"step {_STEP[0]}, {here}"


@contextlib.contextmanager
def stage(name: str, *, step: int | None = None) -> Iterator[None]:
    """Run the block as stage ``name`` (``step``: the training step it belongs to, from now on).

    A collective that fails inside (torch's timeout after ``trainer.distributed_timeout``, a
    peer's connection gone) leaves as :class:`CollectiveFailure` naming this process, the stage
    and where the other processes last were. Stages nest; the main thread's current stage is
    published in the process group's store for the others' messages.
    """
    if step is not None:
        _STEP[0] = step
    _STAGES.open.append([name, None])
    _publish()
    try:
        yield
    except Exception as exc:
        if isinstance(exc, CollectiveFailure) or not _is_collective_failure(exc):
            raise
        raise _explain(exc) from exc
    finally:
        _STAGES.open.pop()
        _publish()


def staged(name: str) -> Callable[[F], F]:
    """Decorator: the function runs as :func:`stage` ``name``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with stage(name):
                return fn(*args, **kwargs)
        return inner  # type: ignore[return-value]

    return wrap


def mark(detail: str) -> None:
    """Name the part of the innermost stage this thread is now in (``mark("update")`` within a step)."""
    if _STAGES.open:
        _STAGES.open[-1][1] = detail
        _publish()


def _group() -> tuple[int, int] | None:
    """(rank, world size) when several processes share a process group, else None."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.get_rank(), dist.get_world_size()


def _store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()  # noqa: SLF001 (no public accessor; guarded by callers)


def _publish() -> None:
    # Where this process is, for a peer that times out waiting for it. The main thread's stage
    # only: a prefetching thread's would hide what the main thread waits in. Best effort.
    group = _group()
    if group is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        store = _store()
        if _NODE_PUBLISHED[0] is not store:  # once per process group: the node does not change
            store.set(_NODE_KEY.format(rank=group[0]), node_label(this_process(group[0])))
            _NODE_PUBLISHED[0] = store
        store.set(_STORE_KEY.format(rank=group[0]), _where())
    except Exception:  # noqa: BLE001 (the store is a diagnostic aid; the run must not depend on it)
        pass


def _peer_stages(rank: int, world: int) -> tuple[dict[int, str], dict[int, str]]:
    """(rank -> last published stage, rank -> node label) of every other process that published
    them (store permitting)."""
    peers: dict[int, str] = {}
    nodes: dict[int, str] = {}
    try:
        store = _store()
        store.set_timeout(datetime.timedelta(seconds=5))  # the job is failing: do not wait long for a diagnosis
        for r in range(world):
            if r == rank:
                continue
            for key, found in ((_STORE_KEY.format(rank=r), peers), (_NODE_KEY.format(rank=r), nodes)):
                if store.check([key]):
                    found[r] = store.get(key).decode()
    except Exception:  # noqa: BLE001
        pass
    return peers, nodes


_COLLECTIVE_SIGNS = ("timed out waiting", "connection closed by peer", "connection reset by peer",
                     "broken pipe", "gloo", "nccl", "watchdog")


def _is_collective_failure(exc: BaseException) -> bool:
    if _group() is None:
        return False
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    # gloo's timeouts and lost peers reach Python as plain RuntimeErrors from its transport
    # ("[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv ...");
    # subclasses (RewardError, VerifierError, ...) are grouprl's own errors, whatever they say
    text = str(exc).lower()
    return type(exc) is RuntimeError and any(sign in text for sign in _COLLECTIVE_SIGNS)


def _explain(exc: BaseException) -> CollectiveFailure:
    rank, world = _group()
    where = _where()
    node = node_label(this_process(rank))
    peers, nodes = _peer_stages(rank, world)
    seen = "; ".join(f"rank {r}{f' ({nodes[r]})' if r in nodes else ''} was last at {s}"
                     for r, s in sorted(peers.items())) or "the other processes' stages are unknown"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    limit = f"={_TIMEOUT[0]:g} s" if _TIMEOUT[0] is not None else ""
    message = (f"rank {rank} of {world} ({node}): a collective failed at {where} (it waits at most "
               f"trainer.distributed_timeout{limit}, or a peer is gone): {seen}; a process stuck or frozen "
               f"elsewhere stops every other one. torch: {first}")
    return CollectiveFailure(message, rank=rank, world_size=world, stage=where, peers=peers, node=node,
                             peer_nodes=nodes)


def has_trainable_vision_tower(model) -> bool:
    """Whether a vision-language policy trains any vision parameter.

    Such a tower gets no gradient from a micro-batch of text-only rows, which DDP
    reports as "Expected to have finished reduction in the prior iteration" unless
    it looks for unused parameters.
    """
    from grouprl.models.loading import find_vision_tower

    found = find_vision_tower(model)
    return found is not None and any(p.requires_grad for p in found[1].parameters())


def is_sharded(model) -> bool:
    """Whether ``model`` has been sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def offload_policy(device: torch.device):
    """FSDP2's ``CPUOffloadPolicy`` for a mesh on ``device``: host memory pinned (faster, asynchronous
    copies to and from the accelerator) only where there is an accelerator to copy to; torch cannot
    pin memory without one ("Found no NVIDIA driver on your system")."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type != "cpu")


def shard_fsdp(model, precision: Precision, device: torch.device, *, offload: bool = False):
    """Shard ``model`` in place with FSDP2 over all processes; returns it.

    Each module whose class is in ``model._no_split_modules`` (decoder layers, vision
    blocks) becomes its own unit, gathered only while it runs; the root holds the
    rest (embeddings, head). Mixed precision gathers parameters in the compute dtype
    and reduces gradients in fp32. ``offload`` (``worker.actor.offload``): every unit gets
    :func:`offload_policy`, so the shards, their gradients and (built after this) the
    optimizer state stay in host memory and the optimizer steps there; a unit's
    parameters are copied to ``device`` for its forward and backward only.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    options = {"mesh": mesh}
    if precision.mixed:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)
    if offload:
        options["offload_policy"] = offload_policy(device)
    unit_names = set(getattr(model, "_no_split_modules", None) or [])
    if not unit_names:
        raise ValueError(f"{type(model).__name__} names no _no_split_modules; cannot choose FSDP units")
    units = [m for m in model.modules() if type(m).__name__ in unit_names]
    for module in units:
        fully_shard(module, **options)
    fully_shard(model, **options)
    return model


def gradient_sync(model, accelerator, enabled: bool) -> ContextManager:
    """Let this backward reduce gradients across processes (the last micro-batch) or not."""
    if enabled or accelerator.num_processes == 1:
        if is_sharded(model):
            model.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if is_sharded(model):
        model.set_requires_gradient_sync(False)
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


def clip_grad_norm(model, accelerator, max_norm: float) -> float:
    """Clip gradients to ``max_norm`` (over all processes' shards) and return the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if is_sharded(model):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)
    return float(accelerator.clip_grad_norm_(params, max_norm))


def batch_moments(values: torch.Tensor, accelerator=None) -> tuple[float, float, int]:
    """(mean, std, n) of ``values`` over every process's elements (``accelerator``'s processes;
    None or one process: these values only, ``grouprl.algorithms.batch_moments``).

    mean = sum x / n,  std = sqrt(sum (x - mean)^2 / (n - 1))  (unbiased; 0 for n < 2), n = total count.
    Float64 sums all-reduced in two passes (count and sum, then the squares about the global
    mean: no cancellation of E[x^2] - E[x]^2). A collective: every process calls it, with
    rows or without.
    """
    from grouprl.algorithms import batch_moments as local_moments

    if accelerator is None or accelerator.num_processes == 1:
        return local_moments(values)
    x = values.detach().reshape(-1).to(torch.float64)
    t = torch.tensor([float(x.numel()), float(x.sum())], dtype=torch.float64, device=accelerator.device)
    torch.distributed.all_reduce(t)
    n, mean = int(t[0]), float(t[1] / t[0].clamp(min=1))
    sq = torch.tensor([float(((x - mean) ** 2).sum())], dtype=torch.float64, device=accelerator.device)
    torch.distributed.all_reduce(sq)
    return mean, float(sq[0] / (n - 1)) ** 0.5 if n > 1 else 0.0, n


def full_named_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every parameter, one at a time, names as in the unwrapped model.

    For a sharded model each tensor is gathered from all processes as it is yielded
    (a collective: every process must consume the whole iterator), so at most one
    full parameter at a time is held beside the shards.
    """
    from grouprl.models.inputs import unwrap_model

    for name, param in unwrap_model(model).named_parameters():
        full = getattr(param, "full_tensor", None)
        if full is not None and param.device.type != param.device_mesh.device_type:
            # an offloaded shard (worker.actor.offload) waits in host memory: gathered on the mesh's
            # device, as torch's own state-dict gathering does
            full = param.to(param.device_mesh.device_type).full_tensor
        yield name, (full() if full is not None else param).detach()


def full_state_dicts(model, optimizer) -> tuple[dict | None, dict]:
    """The whole model (sharded models only; else None) and optimizer state, on the main process.

    A collective for sharded models: every process must call it; the others get empty
    dicts. The optimizer state is keyed by parameter name (not by position), so it
    loads into a model sharded over any number of processes, or not at all.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options) if is_sharded(model) else None
    return model_state, get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state_dicts(model, optimizer, model_state: dict | None, optimizer_state: dict | None) -> None:
    """Load whole (unsharded, name-keyed) state into ``model`` / ``optimizer``, sharding it as they are.

    Every process passes the whole state it read from disk.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True)
    if model_state is not None:
        set_model_state_dict(model, model_state, options=options)
    if optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
