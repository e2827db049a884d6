"""Accounting of DP-AdaFEST steps (private partition selection of embedding rows, then the noised
gradient on the selected rows; :mod:`tf_dp.dp_query.partition_selection`).

Per step the selection is a Gaussian sum query on the sample's contribution map (L2 sensitivity
``C1``, the contribution bound; noise ``sigma1 * C1``), and the gradient a Gaussian sum query
(sensitivity ``C2``, noise ``sigma2 * C2``). The threshold is post-processing. Both are recorded as
sum queries of the same sample, so every accountant reading the ledger (RDP, PLD, GDP) composes
them as one Gaussian of noise multiplier ``(sigma1^-2 + sigma2^-2)^(-1/2)`` (a pair of Gaussians
with independent noise on the same sample; McMahan et al. 2018, Eq. (1)).

Example::

    from tf_dp.ledger import PrivacyLedger
    ledger = PrivacyLedger()
    ledger.record_sampling(60000, 0.01, "poisson")
    ledger.record_sum_query(1.0, 1.1)                       # the gradient (C2=1, sigma2=1.1)
    record_selection(ledger, contribution_bound=1.0, noise_multiplier=3.0)
    # compute_epsilon(ledger, 1e-5) then composes both
"""

from __future__ import annotations

import math

from tf_dp.accounting.ledger_analysis import PrivacyResult, compute_epsilon
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

__all__ = ["selection_event", "record_selection", "adafest_epsilon", "combined_noise_multiplier"]


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not (
        isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def selection_event(contribution_bound: float, noise_multiplier: float) -> SumQueryEvent:
    """The ledger's sum-query event of one partition selection: sensitivity ``C1``, noise
    ``noise_multiplier * C1``."""
    c = _positive("contribution_bound", contribution_bound)
    z = _positive("noise_multiplier", noise_multiplier)
    return SumQueryEvent(l2_sensitivity=c, noise_stddev=z * c)


def record_selection(ledger, contribution_bound, noise_multiplier):
    """Records the selection of the current sample in ``ledger`` (after ``record_sampling``;
    graph-safe: Python numbers for the arguments)."""
    ev = selection_event(contribution_bound, noise_multiplier)
    return ledger.record_sum_query(ev.l2_sensitivity, ev.noise_stddev)


def combined_noise_multiplier(gradient_noise_multiplier: float, selection_noise_multiplier: float
                              ) -> float:
    """``(sigma2^-2 + sigma1^-2)^(-1/2)``: the one Gaussian equivalent to both queries of a step."""
    a = _positive("gradient_noise_multiplier", gradient_noise_multiplier)
    b = _positive("selection_noise_multiplier", selection_noise_multiplier)
    return (a ** -2 + b ** -2) ** -0.5


def adafest_epsilon(
    population_size: int, sampling_probability: float, steps: int,
    gradient_noise_multiplier: float, selection_noise_multiplier: float, delta: float,
    accountant: str = "rdp", contribution_bound: float = 1.0, l2_norm_clip: float = 1.0,
) -> PrivacyResult:
    """Epsilon of ``steps`` Poisson-sampled DP-AdaFEST steps, from the ledger entries they record
    (the accountants in :func:`compute_epsilon`)."""
    if isinstance(steps, bool) or not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    c2 = _positive("l2_norm_clip", l2_norm_clip)
    z2 = _positive("gradient_noise_multiplier", gradient_noise_multiplier)
    entry = SampleEntry(
        SamplingEvent(population_size, sampling_probability, "poisson"),
        (SumQueryEvent(c2, z2 * c2), selection_event(contribution_bound, selection_noise_multiplier)),
    )
    return compute_epsilon([(entry, steps)], delta, accountant)
