"""Membership inference on a trained model: the loss-threshold attack, AUC and TPR at low FPR.

The classic view of privacy leakage (Yeom, Giacomelli, Fredrikson & Jha 2018, "Privacy risk in
machine learning"; the low-FPR reporting of Carlini et al. 2022, "Membership inference attacks from
first principles"): an attacker guesses that an example was trained on when the model's loss on it
is low. :func:`loss_attack` scores every member (training example) and non-member (held-out
example) by minus its loss and reports

* the ROC AUC (probability that a random member scores above a random non-member, ties 1/2);
* the TPR at a few low FPRs: the largest fraction of members caught by a threshold that flags at
  most that fraction of the non-members (measured on these examples: an FPR of ``f`` needs at
  least ``1 / f`` non-members to mean anything).

These are measurements of one attack on one model, not bounds: see :mod:`tf_dp.auditing.many_run`
and :mod:`tf_dp.auditing.one_run` for epsilon lower bounds with a confidence level.

Example::

    from tf_dp.auditing.membership_inference import loss_attack
    result = loss_attack(model, (x_train[:5000], y_train[:5000]), (x_test[:5000], y_test[:5000]),
                         loss="sparse_categorical_crossentropy")
    print(result)        # AUC and TPR at FPR 0.1% and 1%
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from tf_dp.auditing import _checks

__all__ = ["MIResult", "loss_attack", "roc_auc", "tpr_at_fpr"]


def _two_score_sets(member_scores: Any, non_member_scores: Any) -> tuple[np.ndarray, np.ndarray]:
    si = np.asarray(member_scores, dtype=np.float64).reshape(-1)
    so = np.asarray(non_member_scores, dtype=np.float64).reshape(-1)
    if si.size == 0 or so.size == 0:
        raise ValueError("member_scores and non_member_scores must each hold at least one score")
    if not (np.all(np.isfinite(si)) and np.all(np.isfinite(so))):
        raise ValueError("member_scores and non_member_scores must be finite numbers")
    return si, so


def roc_auc(member_scores: Any, non_member_scores: Any) -> float:
    """``P[member score > non-member score] + P[equal] / 2`` (the Mann-Whitney statistic).

    Example::

        roc_auc([0.9, 0.8], [0.1, 0.85])   # 0.75
    """
    si, so = _two_score_sets(member_scores, non_member_scores)
    so_sorted = np.sort(so)
    below = np.searchsorted(so_sorted, si, side="left")
    ties = np.searchsorted(so_sorted, si, side="right") - below
    return float((below.sum() + 0.5 * ties.sum()) / (si.size * so.size))


def tpr_at_fpr(member_scores: Any, non_member_scores: Any, fpr: float) -> float:
    """Largest TPR of a threshold test ``score > t`` whose empirical FPR is at most ``fpr``.

    At most ``floor(fpr * n_out)`` non-members may be flagged, so ``t`` is the next non-member
    score: members strictly above it count.

    Example::

        tpr_at_fpr(member_scores, non_member_scores, 0.01)
    """
    si, so = _two_score_sets(member_scores, non_member_scores)
    fpr = _checks.probability("fpr", fpr)
    allowed = int(np.floor(fpr * so.size + 1e-9))
    if allowed >= so.size:
        return 1.0
    threshold = np.sort(so)[::-1][allowed]
    return float(np.mean(si > threshold))


@dataclasses.dataclass(frozen=True)
class MIResult:
    """What the loss-threshold attack achieved.

    Attributes:
      auc: ROC AUC (0.5: no better than a coin).
      tpr_at_fpr: ``{fpr: tpr}`` for each requested FPR.
      members, non_members: how many examples of each were scored.
      member_loss, non_member_loss: the mean loss on each set.
    """

    auc: float
    tpr_at_fpr: dict
    members: int
    non_members: int
    member_loss: float
    non_member_loss: float

    def __str__(self) -> str:
        rates = ", ".join(f"TPR {t:.2%} at FPR {f:.2%}" for f, t in self.tpr_at_fpr.items())
        return (f"loss-threshold membership inference: AUC {self.auc:.3f}; {rates} "
                f"({self.members} members, mean loss {self.member_loss:.3f}; {self.non_members} "
                f"non-members, mean loss {self.non_member_loss:.3f})")


def loss_attack(
    model: Any,
    members: tuple,
    non_members: tuple,
    *,
    loss: Any = "sparse_categorical_crossentropy",
    fprs: Sequence[float] = (0.001, 0.01),
    batch_size: int = 512,
) -> MIResult:
    """Loss-threshold membership inference on ``model``: score = minus the per-example loss.

    Args:
      model: a trained Keras model (private or not) mapping inputs to the loss's ``y_pred``.
      members: ``(x, y)`` of examples the model was trained on.
      non_members: ``(x, y)`` of examples from the same distribution it was not trained on.
      loss: the Keras loss (name, function or ``keras.losses.Loss``) the attacker evaluates;
        the model's outputs must match it (logits need ``from_logits=True``).
      fprs: false positive rates at which to report the TPR, each in (0, 1).
      batch_size: prediction batch size.

    Returns:
      An :class:`MIResult`.

    Example::

        result = loss_attack(model, (x_train, y_train), (x_test, y_test),
                             loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        result.auc, result.tpr_at_fpr[0.01]
    """
    import keras

    from tf_dp.auditing.canaries import _per_example

    for name, value in (("members", members), ("non_members", non_members)):
        if not (isinstance(value, (tuple, list)) and len(value) == 2
                and len(value[0]) == len(value[1]) and len(value[0]) > 0):
            raise ValueError(f"{name} must be a pair (x, y) with the same number (>= 1) of rows")
    fprs = tuple(_checks.probability("fprs", f) for f in fprs)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    per_example = _per_example(loss)

    def losses(x, y):
        # float64: a float32 loss of a confidently right prediction rounds to 0, and those ties
        # would hide the low-FPR end of the ROC curve
        pred = np.asarray(model.predict(x, batch_size=batch_size, verbose=0), np.float64)
        values = keras.ops.convert_to_numpy(
            per_example(keras.ops.convert_to_tensor(np.asarray(y)), keras.ops.convert_to_tensor(pred)))
        return np.asarray(values, dtype=np.float64)

    loss_in, loss_out = losses(*members), losses(*non_members)
    return MIResult(
        auc=roc_auc(-loss_in, -loss_out),
        tpr_at_fpr={f: tpr_at_fpr(-loss_in, -loss_out, f) for f in fprs},
        members=int(loss_in.size), non_members=int(loss_out.size),
        member_loss=float(loss_in.mean()), non_member_loss=float(loss_out.mean()),
    )
