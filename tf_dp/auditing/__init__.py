"""Empirical privacy auditing: a measured lower bound beside the certified epsilon.

Estimators (numpy/scipy, no TensorFlow):

- :mod:`tf_dp.auditing.many_run`: Clopper-Pearson bounds on an attack's TPR/FPR -> epsilon lower
  bound, threshold chosen on a random half (or fixed thresholds with a union bound).
- :mod:`tf_dp.auditing.one_run`: Steinke, Nasr & Jagielski 2023, one training run, many canaries.
- :mod:`tf_dp.auditing.gaussian`: Gaussian-DP ``mu`` lower bound and estimate.
- :mod:`tf_dp.auditing.membership_inference`: the loss-threshold attack on a trained model (AUC,
  TPR at low FPR), the classic membership-inference view.

Keras (imported on first use): :func:`audit_dp_sgd` trains with canaries
(:mod:`tf_dp.auditing.canaries`) and returns an :class:`AuditReport`. See docs/auditing.md.

Example::

    from tf_dp.auditing import one_run
    bound = one_run.epsilon_lower_bound(scores, included, delta=1e-5, confidence=0.95)
"""

import importlib

from tf_dp.auditing import gaussian, many_run, membership_inference, one_run
from tf_dp.auditing.gaussian import mu_estimate, mu_lower_bound
from tf_dp.auditing.many_run import clopper_pearson
from tf_dp.auditing.many_run import epsilon_lower_bound as many_run_epsilon_lower_bound
from tf_dp.auditing.membership_inference import MIResult, loss_attack
from tf_dp.auditing.one_run import epsilon_lower_bound as one_run_epsilon_lower_bound

_LAZY = {
    "audit_dp_sgd": "tf_dp.auditing.audit",
    "AuditReport": "tf_dp.auditing.audit",
    "THREAT_MODELS": "tf_dp.auditing.audit",
    "CanaryHead": "tf_dp.auditing.canaries",
    "mislabeled_canaries": "tf_dp.auditing.canaries",
    "draw_inclusion": "tf_dp.auditing.canaries",
    "dirac_score": "tf_dp.auditing.canaries",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in ("audit", "canaries"):
        return importlib.import_module(f"tf_dp.auditing.{name}")
    raise AttributeError(f"module 'tf_dp.auditing' has no attribute {name!r}")


__all__ = [
    "AuditReport", "CanaryHead", "MIResult", "THREAT_MODELS", "audit_dp_sgd", "clopper_pearson",
    "dirac_score", "draw_inclusion", "gaussian", "loss_attack", "many_run",
    "many_run_epsilon_lower_bound", "membership_inference", "mislabeled_canaries", "mu_estimate",
    "mu_lower_bound", "one_run", "one_run_epsilon_lower_bound",
]
