"""The flow trainers' batches: one step's sampled images, and the rows an update trains on.

``FlowRollout`` is what a step samples and scores (every algorithm the same); the rows
differ per algorithm, and ``trainer.update.run_update`` cuts either kind into
micro-batches (``len``, ``select`` and ``loss_mask``, one "token" per row):

* ``FlowBatch`` (Flow-GRPO, Flow-GRPO-Fast, GRPO-Guard): (image, trained step) pairs,
  built by ``rows_of`` from the sampler's stored steps;
* ``NFTBatch`` (DiffusionNFT): (image, training time) pairs, built by ``nft_rows`` from
  each image's clean sample noised afresh.

Text conditioning is held once per image and indexed by the rows' ``image``, since a
prompt embedding is far larger than a latent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grouprl.domains.diffusion.pipeline import Conditioning, Schedule, Trajectory
from grouprl.rewards import RewardResult


@dataclass
class FlowBatch:
    """Rows are (image, trained step) pairs: what ``run_update`` cuts into micro-batches.

    Text conditioning is held once per image (``text``) and indexed by ``image``.
    """

    image: torch.Tensor  # [R] index into text / advantages of images
    latents: torch.Tensor  # [R, *latent], the sample before the step
    next_latents: torch.Tensor  # [R, *latent], the sample after it (re-scored)
    old_log_prob: torch.Tensor  # [R]
    old_mean: torch.Tensor  # [R, *latent]
    sigma: torch.Tensor  # [R]
    sigma_next: torch.Tensor  # [R]
    timestep: torch.Tensor  # [R], the transformer's timestep
    advantages: torch.Tensor  # [R]
    text: Conditioning  # per image
    ref_mean: torch.Tensor | None = None  # [R, *latent], the reference's means (KL)

    def __len__(self) -> int:
        return len(self.image)

    @property
    def loss_mask(self) -> torch.Tensor:
        # one "token" per row: run_update's normalisers then count rows
        return torch.ones(len(self), 1)

    def select(self, rows) -> "FlowBatch":
        rows = torch.as_tensor(rows, dtype=torch.long)
        pick = {name: getattr(self, name)[rows] for name in
                ("image", "latents", "next_latents", "old_log_prob", "old_mean", "sigma", "sigma_next", "timestep",
                 "advantages")}
        return FlowBatch(**pick, text=self.text, ref_mean=None if self.ref_mean is None else self.ref_mean[rows])


@dataclass
class FlowRollout:
    """One step's sampled and scored images, n per prompt, rows in prompt order."""

    trajectories: list[Trajectory]  # one per sampler micro-batch: the stored steps' inputs, outputs, log-probs, means
    text: Conditioning  # per image
    rewards: RewardResult  # per image, over every micro-batch
    prompts: list[str]  # per image
    steps: list[int]  # the stored (trained) steps, the same for every image


def rows_of(trajectories: list[Trajectory], sched: Schedule, advantages: torch.Tensor,
            text: Conditioning) -> FlowBatch:
    """Flatten the trajectories' stored steps into rows; every step of an image gets the image's advantage."""
    latents, nxt, logp, means, image, steps = [], [], [], [], [], []
    offset = 0
    for traj in trajectories:
        b, s = traj.log_probs.shape
        latents.append(traj.latents.reshape(b * s, *traj.latents.shape[2:]))
        nxt.append(traj.next_latents.reshape(b * s, *traj.latents.shape[2:]))
        means.append(traj.means.reshape(b * s, *traj.latents.shape[2:]))
        logp.append(traj.log_probs.reshape(b * s))
        image.append((torch.arange(b) + offset).repeat_interleave(s))
        steps.append(torch.tensor(traj.steps, dtype=torch.long).repeat(b))
        offset += b
    step = torch.cat(steps)
    image = torch.cat(image)
    return FlowBatch(image=image, latents=torch.cat(latents), next_latents=torch.cat(nxt), old_log_prob=torch.cat(logp),
                     old_mean=torch.cat(means), sigma=sched.sigmas[step], sigma_next=sched.sigmas[step + 1],
                     timestep=sched.timesteps[step], advantages=advantages[image], text=text)


@dataclass
class NFTBatch:
    """DiffusionNFT's rows: (image, training time) pairs, each with the image's clean sample ``x0``,
    fresh noise, and the old adapter's (and, with a KL term, the reference's) velocity at ``x_t``."""

    image: torch.Tensor  # [R] index into text of images
    x0: torch.Tensor  # [R, *latent], the sampler's clean sample
    noise: torch.Tensor  # [R, *latent], eps of x_t = (1 - t) x0 + t eps
    t: torch.Tensor  # [R], sigma of the time (the noising time)
    timestep: torch.Tensor  # [R], the transformer's timestep
    advantages: torch.Tensor  # [R]
    text: Conditioning  # per image
    v_old: torch.Tensor | None = None  # [R, *latent], the old adapter's velocity (no gradient)
    v_ref: torch.Tensor | None = None  # [R, *latent], the adapters-off velocity (KL)

    def __len__(self) -> int:
        return len(self.image)

    @property
    def loss_mask(self) -> torch.Tensor:
        return torch.ones(len(self), 1)

    def select(self, rows) -> "NFTBatch":
        rows = torch.as_tensor(rows, dtype=torch.long)
        pick = {name: getattr(self, name)[rows] for name in ("image", "x0", "noise", "t", "timestep", "advantages")}
        return NFTBatch(**pick, text=self.text, v_old=None if self.v_old is None else self.v_old[rows],
                        v_ref=None if self.v_ref is None else self.v_ref[rows])


def nft_rows(finals: list[torch.Tensor], sched: Schedule, advantages: torch.Tensor, text: Conditioning,
             times: int, generator: torch.Generator) -> NFTBatch:
    """Each image's ``times`` training times, drawn without replacement from the rollout schedule's
    (a random permutation per image, as NVlabs' trainer), each row with its own fresh noise."""
    x0 = torch.cat(finals)
    order = torch.stack([torch.randperm(sched.num_steps, generator=generator)[:times] for _ in range(len(x0))])
    image = torch.arange(len(x0)).repeat_interleave(times)
    step = order.reshape(-1)
    noise = torch.randn((len(image), *x0.shape[1:]), generator=generator).to(x0)
    return NFTBatch(image=image, x0=x0[image], noise=noise, t=sched.sigmas[step], timestep=sched.timesteps[step],
                    advantages=advantages[image], text=text)
