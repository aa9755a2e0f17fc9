"""Gradient statistics at the job's reference batch, from real micro-batch gradients.

Pollux (Qiao et al., OSDI'21, §3.1) needs |g|² (``grad_sqr``) and tr(Σ)/M0
(``grad_var``) to know the job's statistical efficiency. One *round* here is
Pollux's per-replica estimator run on one device: the reference batch M0 is
split into ``n`` micro-batches of ``b = M0 // n`` fresh samples; the gradient
of each is computed on the same parameters (no optimizer step), giving
|G_b|² for each and |G_B|² of their average, B = n·b. McCandlish et al.
(2018, App. A.1) turn the pair into unbiased estimates (see
:mod:`goodput.efficiency`); :class:`~goodput.efficiency.GradientNoiseTracker`
averages the rounds with bias correction.

Contract: ``loss_fn(model, batch)`` returns the *mean* loss over the batch
(torch's losses do by default), so a micro-batch's gradient is the average
over its samples.

Example::

    stats = gradient_noise(model, loss_fn, make_batch, "cpu", init_batch_size=64, rounds=4)
    stats.grad_sqr, stats.grad_var, stats.noise_scale
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from goodput.efficiency import GradientNoiseTracker
from goodput.validation import check_int

__all__ = ["GradientStats", "gradient_noise", "flat_grad"]


@dataclass(frozen=True)
class GradientStats:
    """Gradient statistics of a job at its reference batch.

    Attributes:
        grad_sqr: |g|², squared norm of the true gradient (> 0).
        grad_var: tr(Σ)/M0 (>= 0).
        init_batch_size: the reference batch M0, samples.
        micro_bsz: samples per micro-batch b.
        micro_batches: micro-batches per round n (B = n·b).
        rounds: rounds averaged.
    """

    grad_sqr: float
    grad_var: float
    init_batch_size: int
    micro_bsz: int
    micro_batches: int
    rounds: int

    @property
    def noise_scale(self) -> float:
        """φ = M0 · grad_var / grad_sqr, samples."""
        return self.init_batch_size * self.grad_var / self.grad_sqr


def flat_grad(model: Any) -> Any:
    """All parameter gradients of ``model`` as one float64 vector (missing gradients are zeros; a sparse
    gradient, as ``nn.Embedding(sparse=True)`` gives, densified)."""
    import torch

    parts = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if g.layout != torch.strided:
            g = g.to_dense()
        parts.append(g.detach().reshape(-1).to(torch.float64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def gradient_noise(
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    make_batch: Callable[[int, Any], Any],
    device: Any,
    init_batch_size: int,
    *,
    micro_batches: int = 4,
    rounds: int = 8,
    min_rounds: int = 2,
    deadline: float | None = None,
    check_loss: Callable[[Any, int], None] | None = None,
) -> GradientStats:
    """Estimate ``grad_sqr`` and ``grad_var`` at ``init_batch_size`` from real gradients.

    Args:
        model: the model, already on ``device``. Its parameters are not changed; its ``.grad`` fields
            are cleared. It runs in training mode, as in training, and is put back in the mode it was in;
            its buffers (BatchNorm's running statistics) are restored too.
        loss_fn: ``loss_fn(model, batch) -> scalar mean loss``.
        make_batch: ``make_batch(batch_size, device) -> batch``.
        device: where the batches go.
        init_batch_size: the reference batch M0, samples.
        micro_batches: n >= 2 micro-batches per round; b = max(1, M0 // n).
        rounds: at most this many rounds, each on fresh samples.
        min_rounds: at least this many, even past ``deadline``.
        deadline: a ``time.perf_counter()`` value after which no new round starts.
        check_loss: called with each micro-batch loss and ``b``; raises if the
            loss is unusable (non-finite, not a scalar).
    """
    init_batch_size = check_int("init_batch_size", init_batch_size, minimum=1)
    n = check_int("micro_batches", micro_batches, minimum=2)
    rounds = check_int("rounds", rounds, minimum=1)
    min_rounds = min(check_int("min_rounds", min_rounds, minimum=1), rounds)
    b = max(1, init_batch_size // n)
    import torch

    tracker = GradientNoiseTracker(init_batch_size)
    was_training = model.training
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    model.train()
    try:
        done = _rounds(model, loss_fn, make_batch, device, tracker, n, b, rounds, min_rounds, deadline, check_loss)
    finally:
        for p in model.parameters():
            p.grad = None
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        model.train(was_training)
    return GradientStats(tracker.grad_sqr, tracker.grad_var, init_batch_size, b, n, done)


def _rounds(model: Any, loss_fn: Callable[[Any, Any], Any], make_batch: Callable[[int, Any], Any], device: Any,
            tracker: GradientNoiseTracker, n: int, b: int, rounds: int, min_rounds: int, deadline: float | None,
            check_loss: Callable[[Any, int], None] | None) -> int:
    """:func:`gradient_noise`'s rounds of ``n`` micro-batches of ``b`` samples each; returns how many ran."""
    done = 0
    for r in range(rounds):
        if r >= min_rounds and deadline is not None and time.perf_counter() >= deadline:
            break
        total = None
        sqr_norms = []
        for _ in range(n):
            batch = make_batch(b, device)
            for p in model.parameters():
                p.grad = None
            loss = loss_fn(model, batch)
            if check_loss is not None:
                check_loss(loss, b)
            loss.backward()
            g = flat_grad(model)
            sqr_norms.append(float(g.dot(g)))
            total = g if total is None else total + g
        mean = total / n
        total_sqr = float(mean.dot(mean))
        if not (all(math.isfinite(s) for s in sqr_norms) and math.isfinite(total_sqr)):
            raise FloatingPointError(f"non-finite gradient norm at micro-batch size {b}")
        tracker.update_micro_batches(sqr_norms, total_sqr, micro_bsz=b)
        done += 1
    return done
