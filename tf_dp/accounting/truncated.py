"""Accounting for truncated Poisson sampling (policy ``truncated_poisson``) with Gaussian noise.

The mechanism (``tf_dp.data.truncated_poisson_batches``): every record joins the step's sample
independently with probability ``q``; if the sample holds more than ``B`` records, a uniformly
random ``B`` of them are kept; the clipped gradients of the kept records are summed and Gaussian
noise of standard deviation ``z C`` is added.

**Analysis** (add/remove adjacency; the same decomposition as Chua et al. 2024, "Scalable DP-SGD:
Shuffling vs. Poisson Subsampling", and dp_accounting's ``TruncatedSubsampledGaussianDpEvent``,
derived here with an add/remove pair in the truncated case). Let ``x*`` be the record in which the
neighbours differ and ``m`` the number of *other* records, ``K ~ Binomial(m, q)`` how many of them
are sampled. The event ``E = {K >= B}`` depends on the other records' coins only, so it has the
same probability ``w = P[Binomial(m, q) >= B]`` under both neighbours, and revealing it only
weakens the guarantee: the step is dominated by the mixture, with public index, of

* off ``E`` (weight ``1 - w``): nothing is dropped whether or not ``x*`` is sampled, so the step is
  the Poisson-subsampled Gaussian: rate ``q``, sensitivity ``C``;
* on ``E`` (weight ``w``): without ``x*`` the batch is a uniform ``B``-subset ``T`` of the sample
  (uniform whatever ``K``); with ``x*`` it is ``x*`` plus a uniform ``(B - 1)``-subset with
  probability ``a = B P[Binomial(m + 1, q) >= B + 1] / ((m + 1) w)`` (``= q E[B / (K + 1) | E]``),
  and a uniform ``B``-subset of the others otherwise. Coupling the ``(B - 1)``-subset with ``T``
  minus a uniform member of ``T`` makes the two sums differ by ``x* - x_j``, of norm at most
  ``2C``. So this component is the Poisson-subsampled Gaussian with rate ``a`` and sensitivity
  ``2C`` (noise multiplier ``z / 2``), whose add/remove pair dominates both directions.

The composition of such mixtures is what the PLD accountant (``pld.Mixture``) and the RDP
accountant (``exp((alpha - 1) R) = sum_k w_k exp((alpha - 1) R_k)`` for a public index) compose.
``m`` depends on which neighbour is the run's data set: ``n - 1`` when the neighbour lacks a record
of the run's ``n``, ``n`` when it has one more. A whole run compares one fixed pair of data sets,
so each case is composed over all the steps, and the reported bound is the worse of the two
(:data:`NEIGHBOURS`). dp_accounting's event uses ``m = n - 1`` and a replace-one pair for the
truncated component (looser than the add/remove pair used here).

Example::

    from tf_dp.accounting import truncated
    truncated.truncation_split(60000, 256 / 60000, 307, "smaller")   # (w, a)
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy import special, stats

from tf_dp.accounting import pld as _pld
from tf_dp.accounting import rdp as _rdp

__all__ = ["NEIGHBOURS", "truncation_split", "pld_mechanism", "rdp_curve"]

#: Which neighbour of the run's data set (of ``n`` records) is compared: ``smaller`` lacks one of
#: its records (``m = n - 1`` others), ``larger`` has one more (``m = n`` others).
NEIGHBOURS = ("smaller", "larger")


def _others(n: int, neighbour: str) -> int:
    if neighbour not in NEIGHBOURS:
        raise ValueError(f"neighbour must be one of {NEIGHBOURS}, got {neighbour!r}")
    return n - 1 if neighbour == "smaller" else n


def truncation_split(n: int, q: float, max_batch_size: int, neighbour: str) -> tuple[float, float]:
    """``(w, a)``: the probability ``w`` that the other records fill the batch (``K >= B``) and,
    given that, the probability ``a`` that the differing record is in the kept batch.

    ``w = 0`` (and ``a = 0``) when the others cannot fill ``B``. ``a`` is computed from log
    survival functions (no underflow for tiny ``w``) and never exceeds ``q``.

    Example: ``truncation_split(1000, 0.01, 10, "smaller")``.
    """
    b = int(max_batch_size)
    if b < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    m = _others(int(n), neighbour)
    if m < b or q == 0.0:
        return 0.0, 0.0
    log_w = float(stats.binom.logsf(b - 1, m, q))
    if not math.isfinite(log_w):
        return 0.0, 0.0
    log_a = math.log(b) + float(stats.binom.logsf(b, m + 1, q)) - math.log(m + 1) - log_w
    return math.exp(log_w), min(q, math.exp(log_a))


def pld_mechanism(n: int, q: float, max_batch_size: int, noise_multiplier: float,
                  neighbour: str):
    """The PLD mechanism (``pld.Mixture`` with a public index) that dominates one truncated step.

    Example: ``pld.pld_epsilon([(pld_mechanism(60000, 0.004, 300, 1.0, "larger"), 1000)], 1e-5)``.
    """
    w, a = truncation_split(n, q, max_batch_size, neighbour)
    plain = _pld.SubsampledGaussian(q, noise_multiplier)
    if w == 0.0:
        return plain
    if w >= 1.0:
        return _pld.SubsampledGaussian(a, noise_multiplier / 2.0)
    return _pld.Mixture(
        components=(plain, _pld.SubsampledGaussian(a, noise_multiplier / 2.0)),
        weights=(1.0 - w, w),
    )


def rdp_curve(n: int, q: float, max_batch_size: int, noise_multiplier: float,
              orders: Sequence[float], neighbour: str) -> np.ndarray:
    """RDP curve of one truncated step: ``R(alpha) = log((1 - w) e^{(alpha-1) R_q} + w
    e^{(alpha-1) R_a}) / (alpha - 1)`` with ``R_q`` the Poisson-subsampled Gaussian of rate ``q``
    and ``R_a`` that of rate ``a`` at noise multiplier ``z / 2`` (Renyi divergence of a mixture
    with public index).

    Example: ``rdp_curve(60000, 0.004, 300, 1.0, [2, 4, 8], "larger") * 1000``.
    """
    a_orders = np.asarray(orders, dtype=np.float64)
    w, a = truncation_split(n, q, max_batch_size, neighbour)
    plain = _rdp.rdp_poisson_gaussian(q, noise_multiplier, a_orders)
    if w == 0.0:
        return plain
    swapped = _rdp.rdp_poisson_gaussian(a, noise_multiplier / 2.0, a_orders)
    with np.errstate(over="ignore", invalid="ignore"):
        terms = np.stack([(a_orders - 1.0) * plain, (a_orders - 1.0) * swapped])
        log_mix = special.logsumexp(terms, axis=0, b=np.array([[1.0 - w], [w]]))
        out = log_mix / (a_orders - 1.0)
    return np.where(np.isnan(out), np.inf, out)
