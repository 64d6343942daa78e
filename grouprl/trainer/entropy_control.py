"""The entropy bonus's coefficient over a run: fixed, or Skywork-OR1's controller as TRL runs it.

``worker.actor.entropy_coeff`` is the coefficient (the adaptive controller's start);
``worker.actor.entropy_control`` the controller (``grouprl.algorithms.entropy`` has its rules).
During one optimizer step every micro-batch applies the coefficient set at the end of the
previous step (:meth:`EntropyControl.applied`); at the step's end (:meth:`EntropyControl.step_end`,
called by ``run_update`` on every process together) the adaptive controller takes the entropy
of every loss token of the step, summed and counted over the micro-batches and the processes
(one token-weighted mean), and moves the coefficient for the next step. Its state (the
coefficient and the last entropy) goes into checkpoints under ``trainer_state.json``'s
``extra.entropy_control`` and is restored on resume.

Logged at each optimizer step: ``actor/entropy_coeff``, the coefficient after the step's update
(TRL's ``entropy_coef``), and ``actor/entropy_coeff_applied``, the one the step's loss used (0
while the adaptive gate is shut). Nothing is logged when the bonus is off.
"""

from __future__ import annotations

import math

import torch

from grouprl import algorithms
from grouprl.config.schema import EntropyControlConfig
from grouprl.trainer.metrics import StepMetrics

STATE_KEY = "entropy_control"  # trainer_state.json's extra key


class EntropyControl:
    """The coefficient, the last measured entropy and the current step's entropy sums (one per trainer)."""

    def __init__(self, coef: float, config: EntropyControlConfig, *, accelerator=None):
        self.coef = float(coef)
        self.config = config
        self.accelerator = accelerator
        self.last_entropy = math.inf  # none measured yet: the adaptive gate is shut (TRL's start)
        self._window = [0.0, 0.0]  # sum of H x M, sum of M over the step's micro-batches on this process

    @property
    def enabled(self) -> bool:
        """The bonus can be non-zero in this run (adaptive mode can raise a coefficient that starts at 0)."""
        return self.coef != 0 or self.config.adaptive

    def applied(self) -> float:
        """The coefficient the loss uses now (``algorithms.applied_entropy_coef``)."""
        return algorithms.applied_entropy_coef(self.coef, self.last_entropy, adaptive=self.config.adaptive,
                                               target=self.config.target)

    def observe(self, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """Add a micro-batch's per-token entropy [b, T] over its loss mask to the step's sums (adaptive only)."""
        if not self.config.adaptive:
            return
        m = mask.detach().to(torch.float64)
        values = torch.where(m != 0, entropy.detach().to(torch.float64), 0.0)
        self._window[0] += float((values * m).sum())
        self._window[1] += float(m.sum())

    def step_end(self, metrics: StepMetrics) -> None:
        """At an optimizer step's end, on every process: the adaptive update from the step's entropy over all
        processes; the coefficients logged. A step with no loss token leaves the coefficient as it is."""
        if not self.enabled:
            return
        used = self.applied()
        if self.config.adaptive:
            totals = torch.tensor(self._window, dtype=torch.float64)
            self._window = [0.0, 0.0]
            if self.accelerator is not None and self.accelerator.num_processes > 1:
                totals = totals.to(self.accelerator.device)
                torch.distributed.all_reduce(totals)
            entropy_sum, tokens = float(totals[0]), float(totals[1])
            if tokens > 0:
                entropy = entropy_sum / tokens
                c = self.config
                self.coef = algorithms.adaptive_entropy_coef(self.coef, entropy, target=c.target,
                                                             coef_min=c.coef_min, coef_max=c.coef_max, delta=c.delta)
                self.last_entropy = entropy
        metrics.mean("actor/entropy_coeff", self.coef)
        metrics.mean("actor/entropy_coeff_applied", used)

    def state(self) -> dict:
        """What a checkpoint keeps; the last entropy None before any was measured (JSON has no inf)."""
        return {"coef": self.coef, "last_entropy": None if math.isinf(self.last_entropy) else self.last_entropy}

    def load(self, state: dict | None) -> None:
        """Restore :meth:`state` under the adaptive controller (a fixed coefficient is the config's)."""
        if not state or not self.config.adaptive:
            return
        self.coef = float(state["coef"])
        last = state.get("last_entropy")
        self.last_entropy = math.inf if last is None else float(last)
