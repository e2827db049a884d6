"""Privacy accounting for DP training: ledger or hyperparameters -> privacy guarantee.

Pure numpy/scipy (no TensorFlow).  Which accountant to use (see docs/accounting.md):

* ``rdp`` (default): Renyi DP with the tight conversion; certified, fast.
* ``moments``: Abadi et al. 2016's moments accountant (same RDP curve, their tail bound); certified,
  reproduces the paper's numbers.
* ``pld``: privacy loss distributions composed by FFT with pessimistic discretisation; certified
  and the tightest; the only accountant for JL steps.
* ``gdp``: mu-GDP via the privacy CLT (Bu et al. 2019); an approximation, labelled as such.

Tradeoff curves (f-DP) of a run: ``pld_tradeoff`` (certified) and ``gaussian_tradeoff`` (mu-GDP),
see ``tf_dp.accounting.tradeoff``.

Example (``compute_epsilon(ledger_or_file, delta)`` does the same from a ledger of what ran):

>>> from tf_dp.accounting import dp_sgd_epsilon
>>> result = dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=60)
>>> round(result.epsilon, 3), result.certified
(2.594, True)
"""

from tf_dp.accounting.balls_in_bins import (
    BallsInBinsEstimate,
    balls_in_bins_estimate,
    balls_in_bins_ledger_estimate,
)
from tf_dp.accounting.calibration import calibrate_noise_multiplier
from tf_dp.accounting.gdp import (
    delta_from_mu,
    epsilon_from_mu,
    mu_poisson,
    mu_uniform,
    reduced_noise,
)
from tf_dp.accounting.jl import jl_delta, jl_epsilon, jl_mechanism
from tf_dp.accounting.ledger_analysis import (
    ACCOUNTANTS,
    MAX_STEPS,
    MIN_NOISE_MULTIPLIER,
    PrivacyResult,
    compute_delta,
    compute_epsilon,
    dp_sgd_entries,
    dp_sgd_epsilon,
    dp_sgd_run,
    effective_noise_multipliers,
    sampling_claims,
    shuffle_epoch_runs,
    shuffle_epochs,
    shuffle_steps_per_epoch,
)
from tf_dp.accounting.matrix_factorization import (
    MFPrivacy,
    amplified_bandmf_epsilon,
    calibrate_mf_noise,
    mf_epsilon,
    mf_epsilon_from_ledger,
    mf_matrix_from_config,
    mf_sensitivity,
)
from tf_dp.accounting.pld import Mixture, SubsampledGaussian, pld_delta, pld_epsilon
from tf_dp.accounting.rdp import (
    DEFAULT_ORDERS,
    MOMENTS_ORDERS,
    delta_from_rdp,
    epsilon_from_rdp,
    rdp_poisson_gaussian,
)
from tf_dp.accounting.strong_composition import (
    dp_sgd_strong_composition_epsilon,
    strong_composition,
)
from tf_dp.accounting.tradeoff import (
    gaussian_tradeoff,
    pld_delta_curve,
    pld_tradeoff,
    tradeoff_from_epsilon_delta,
)

__all__ = [
    "MFPrivacy",
    "amplified_bandmf_epsilon",
    "calibrate_mf_noise",
    "mf_epsilon",
    "mf_epsilon_from_ledger",
    "mf_matrix_from_config",
    "mf_sensitivity",
    "BallsInBinsEstimate",
    "balls_in_bins_estimate",
    "balls_in_bins_ledger_estimate",
    "ACCOUNTANTS",
    "DEFAULT_ORDERS",
    "MAX_STEPS",
    "MIN_NOISE_MULTIPLIER",
    "MOMENTS_ORDERS",
    "Mixture",
    "PrivacyResult",
    "SubsampledGaussian",
    "calibrate_noise_multiplier",
    "compute_delta",
    "compute_epsilon",
    "delta_from_mu",
    "delta_from_rdp",
    "dp_sgd_entries",
    "dp_sgd_epsilon",
    "sampling_claims",
    "dp_sgd_run",
    "dp_sgd_strong_composition_epsilon",
    "effective_noise_multipliers",
    "epsilon_from_mu",
    "epsilon_from_rdp",
    "gaussian_tradeoff",
    "jl_delta",
    "jl_epsilon",
    "jl_mechanism",
    "mu_poisson",
    "mu_uniform",
    "pld_delta",
    "pld_delta_curve",
    "pld_epsilon",
    "pld_tradeoff",
    "rdp_poisson_gaussian",
    "reduced_noise",
    "shuffle_epoch_runs",
    "shuffle_epochs",
    "shuffle_steps_per_epoch",
    "strong_composition",
    "tradeoff_from_epsilon_delta",
]
