"""Empirical privacy auditing: a measured lower bound beside the certified epsilon.

Estimators (numpy/scipy, no TensorFlow):

- :mod:`tf_dp.auditing.many_run`: Clopper-Pearson bounds on an attack's TPR/FPR -> epsilon lower
  bound, threshold chosen on a random half (or fixed thresholds with a union bound).
- :mod:`tf_dp.auditing.one_run`: Steinke, Nasr & Jagielski 2023, one training run, many canaries.
- :mod:`tf_dp.auditing.gaussian`: Gaussian-DP ``mu`` lower bound and estimate.
- :mod:`tf_dp.auditing.profile`: tests a whole certified privacy profile (every certified
  ``(eps(delta), delta)`` pair) at thresholds fixed in advance, and the power of that test.
- :mod:`tf_dp.auditing.membership_inference`: the loss-threshold attack on a trained model (AUC,
  TPR at low FPR), the classic membership-inference view.

Keras (imported on first use): :func:`audit_dp_sgd` trains with canaries
(:mod:`tf_dp.auditing.canaries`) and returns an :class:`AuditReport`. See docs/auditing.md.

Example::

    from tf_dp.auditing import one_run
    bound = one_run.epsilon_lower_bound(scores, included, delta=1e-5, confidence=0.95)
"""

from tf_dp.auditing import gaussian, many_run, membership_inference, one_run, profile
from tf_dp.auditing.gaussian import mu_estimate, mu_lower_bound
from tf_dp.auditing.many_run import clopper_pearson
from tf_dp.auditing.many_run import epsilon_lower_bound as many_run_epsilon_lower_bound
from tf_dp.auditing.membership_inference import MIResult, loss_attack
from tf_dp.auditing.one_run import epsilon_lower_bound as one_run_epsilon_lower_bound

_AUDIT = ("audit_dp_sgd", "AuditReport", "PowerCalculation", "THREAT_MODELS")
_CANARIES = ("CanaryHead", "mislabeled_canaries", "draw_inclusion", "dirac_score")


def __getattr__(name):
    # The Keras side, imported on first use (the estimators above need no TensorFlow).
    if name in _AUDIT or name == "audit":
        import tf_dp.auditing.audit as audit  # not "from tf_dp.auditing import": that asks
        # this __getattr__ for "audit" again

        globals().update({n: getattr(audit, n) for n in _AUDIT})
        return audit if name == "audit" else globals()[name]
    if name in _CANARIES or name == "canaries":
        import tf_dp.auditing.canaries as canaries

        globals().update({n: getattr(canaries, n) for n in _CANARIES})
        return canaries if name == "canaries" else globals()[name]
    raise AttributeError(f"module 'tf_dp.auditing' has no attribute {name!r}")


__all__ = [
    "AuditReport", "CanaryHead", "MIResult", "PowerCalculation", "THREAT_MODELS", "audit_dp_sgd",
    "clopper_pearson",
    "dirac_score", "draw_inclusion", "gaussian", "loss_attack", "many_run",
    "many_run_epsilon_lower_bound", "membership_inference", "mislabeled_canaries", "mu_estimate",
    "mu_lower_bound", "one_run", "one_run_epsilon_lower_bound", "profile",
]
