"""Tensor-parallel rollouts over the training processes: which ranks share one vLLM engine, and their prompts.

With ``worker.rollout.tensor_parallel_size: tp > 1`` the colocated vllm engine
(``grouprl.rollout.vllm_engine``) is one vLLM engine per *group* of ``tp`` training
processes, started with ``distributed_executor_backend="external_launcher"`` as verl's
hybrid engine starts it: processes ``[0 .. tp-1]`` form the first engine,
``[tp .. 2tp-1]`` the next, and so on (vLLM's own layout of a launcher's world:
``arange(world).reshape(-1, tp)``, the data-parallel dimension outermost). Each process
holds one shard of the model's weights, and every process of a group must call
``generate`` with the same prompts and the same sampling seeds. The trainer, though,
gives every process its own prompts. So a group gathers its members' prompts, samples
their union once, and each member takes back the rows of its own prompts.

This module holds the arithmetic of that, as plain functions tested without vLLM or a
process group: the groups, and the union and the split. The engine does the collectives;
the layout a run may ask for is checked with the config
(``grouprl.config.checks.check_tensor_parallel_layout``).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

def tensor_parallel_groups(world_size: int, tensor_parallel_size: int) -> list[list[int]]:
    """The ranks of each tensor-parallel group: group g is ranks ``[g*tp, ..., g*tp + tp - 1]``.

    The layout vLLM's ``initialize_model_parallel`` gives a launcher's world
    (``arange(world).reshape(-1, tp)``), so grouprl's groups are vLLM's.
    """
    if tensor_parallel_size < 1 or world_size % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} does not divide world size {world_size}")
    tp = tensor_parallel_size
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def tensor_parallel_group_index(rank: int, tensor_parallel_size: int) -> int:
    """Which group ``rank`` belongs to: ``rank // tp``.

    The engine's seed is ``trainer.seed + group``, the same on every member: vLLM needs
    one seed per engine, and its shards must sample the same tokens.
    """
    return rank // tensor_parallel_size


def union_of_requests(members: Sequence[Sequence[T]], key: Callable[[T], Hashable | None] = lambda item: None,
                      ) -> tuple[list[T], list[list[int]]]:
    """The requests a group samples once, and where each member's requests are among them.

    ``members[m]`` are member m's requests in its order (the group's members in rank
    order). Returns ``(union, takes)``: ``union`` is every request, member by member,
    except that a request whose ``key`` is not None and equals an earlier one's is taken
    once (the same prompt with the same seed samples the same tokens; a request that may
    not be shared, e.g. unseeded sampling, has key None); ``takes[m][j]`` is the index in
    ``union`` of member m's j-th request, so ``[union[i] for i in takes[m]] == members[m]``.
    """
    union: list[T] = []
    first: dict[Hashable, int] = {}
    takes: list[list[int]] = []
    for requests in members:
        mine: list[int] = []
        for item in requests:
            k = key(item)
            if k is not None and k in first:
                mine.append(first[k])
                continue
            if k is not None:
                first[k] = len(union)
            mine.append(len(union))
            union.append(item)
        takes.append(mine)
    return union, takes


def rows_of_member(outputs: Sequence[T], takes: Sequence[int]) -> list[T]:
    """One member's outputs, in its own order: ``[outputs[i] for i in takes]`` (one output per union request)."""
    if any(not 0 <= i < len(outputs) for i in takes):
        raise ValueError(f"a member's request index is outside the {len(outputs)} outputs of the group's call")
    return [outputs[i] for i in takes]


def request_key(request: dict[str, Any], sampling: dict[str, Any]) -> str | None:
    """A key under which two identical requests (prompt, images, sampling settings) are sampled once, or None.

    Only deterministic requests share: a seeded one (``sampling["seed"]``: vLLM draws its
    samples from a generator of that seed alone) or a greedy one (temperature 0). An
    unseeded request draws from the engine's running generator, so two of them are two
    independent draws and are both kept. The key is a digest of the pickled pair (the
    images' pixels included).
    """
    if sampling.get("seed") is None and sampling.get("temperature", 1.0) != 0.0:
        return None
    return hashlib.sha256(pickle.dumps((request, sorted(sampling.items(), key=lambda kv: kv[0])))).hexdigest()


__all__ = ["request_key", "rows_of_member", "tensor_parallel_group_index", "tensor_parallel_groups",
           "union_of_requests"]
