"""Audit a DP-SGD configuration end to end: train with canaries, attack, report.

:func:`audit_dp_sgd` trains fresh private models (``tf_dp.keras.make_private`` + the DP optimizer
you build, through the ordinary ``model.fit`` on ``tf_dp.data.poisson_batches``) with canaries
included at random, scores the canaries, and returns an :class:`AuditReport`: the certified
epsilon from each run's ledger next to the measured lower bounds.

Example::

    import keras, numpy as np, tf_dp
    from tf_dp.auditing import audit_dp_sgd

    report = audit_dp_sgd(
        model_fn=lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
        optimizer_fn=lambda: tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=2.0, learning_rate=0.1,
            gradient_mode="vectorized"),
        x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampling_probability=1.0, steps=10, num_canaries=1000, delta=1e-5)
    print(report)
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional

import keras
import numpy as np

from tf_dp._progress import counted
from tf_dp.accounting import compute_epsilon
from tf_dp.accounting.ledger_analysis import PrivacyResult
from tf_dp.auditing import _checks, gaussian, many_run, one_run, profile
from tf_dp.auditing._checks import percent as _percent
from tf_dp.auditing.canaries import (
    CanaryHead,
    dirac_score,
    draw_inclusion,
    mislabeled_canaries,
    per_example_output_loss,
)

__all__ = ["AuditReport", "PowerCalculation", "audit_dp_sgd", "THREAT_MODELS"]

#: ``white_box``: Dirac gradient canaries, all iterates visible (per-step updates -> score);
#: ``white_box_gradient``: the same adversary (Nasr et al. 2023), audited for power: every canary
#: is a record (out-canaries have zero gradient), the whole certified privacy profile is tested at
#: thresholds fixed in advance, and the report gives the smallest violation it detects;
#: ``black_box``: mislabeled input canaries, the final model's loss is the score.
THREAT_MODELS = ("white_box", "white_box_gradient", "black_box")

#: The probability of detection that :class:`PowerCalculation` is computed for.
POWER_PROBABILITY = 0.9


@dataclasses.dataclass(frozen=True)
class PowerCalculation:
    """The smallest violation the audit's budget detects (``white_box_gradient``).

    Alternatives: the configured DP-SGD run with its noise multiplier divided by ``noise_factor``
    (everything else as recorded). Simulated from that mechanism at the audit's thresholds and
    trial counts, a run with the noise divided by ``noise_factor`` or more is flagged
    (``violation=True``) with probability ``>= probability`` (exact binomial quantiles, see
    :func:`tf_dp.auditing.profile.detection_probability_bound`; simulation error aside).

    Attributes:
      probability: the detection probability (0.9).
      noise_factor: the smallest factor on the grid that is detected (``inf``: none up to the
        largest factor tried).
      noise_multiplier: the configured noise multiplier divided by ``noise_factor``.
      epsilon: that run's epsilon at the report's delta (same accountant as the certificate):
        the smallest epsilon violation detected with ``probability``.
      certified_epsilon: the certificate it is compared with.
      trials_in, trials_out: canaries in / out the calculation used.
    """

    probability: float
    noise_factor: float
    noise_multiplier: float
    epsilon: float
    certified_epsilon: float
    trials_in: int
    trials_out: int

    def __str__(self) -> str:
        if math.isinf(self.noise_factor):
            return (f"power: no run with less noise (down to 1/{_MAX_FACTOR:g} of the recorded) "
                    f"is flagged with probability {self.probability:g} at {self.trials_in} in / "
                    f"{self.trials_out} out canaries")
        return (f"power: a run whose noise multiplier is {self.noise_multiplier:.3g} (the "
                f"recorded divided by {self.noise_factor:.3g}, epsilon = {self.epsilon:.3f}, "
                f"{self.epsilon / self.certified_epsilon:.2f}x the certified {self.certified_epsilon:.3f}) "
                f"or less is flagged with probability >= {self.probability:g} "
                f"({self.trials_in} in / {self.trials_out} out canaries)")


_MAX_FACTOR = 20.0


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What an audit measured, beside what the ledger certifies.

    Confidence: the report's lower bounds (one-run, and many-run and the GDP bound when the trials
    are independent) hold *together* with probability :attr:`confidence`. :func:`audit_dp_sgd`
    splits ``1 - confidence`` evenly between the ``k`` bounds it computes (Bonferroni: each at
    ``1 - (1 - confidence) / k``), so :attr:`lower_bound` (the largest of them) and
    :attr:`violation` hold at the stated ``confidence``, not at the lower level that the
    largest of ``k`` bounds each at ``confidence`` would have. The GDP *estimate* is not a bound:
    its interval is at ``confidence`` by itself.

    Attributes:
      certified: the largest certified statement over the trainings (each canary is in one
        training only, so this is the guarantee the audit tests).
      one_run: Steinke et al. 2023 bound over all canaries (valid whatever their dependence).
      many_run: Clopper-Pearson bound treating canaries as independent trials (white-box Dirac
        canaries under Poisson sampling, or black-box with one canary per training), else None.
        White-box with a plain-SGD optimizer and a numeric noise multiplier: at one threshold
        fixed from a simulation of the configured mechanism (every trial counts); otherwise the
        threshold is chosen on a random half.
      gdp_bound: ``mu`` lower bound (Clopper-Pearson, split threshold) and its epsilon, valid when
        the mechanism is Gaussian-DP (exactly so for full-batch DP-SGD); None when ``many_run`` is.
      gdp_estimate: white-box only: ``mu`` from the mean/std of the scores, an ESTIMATE.
      threat_model: ``"white_box"``, ``"white_box_gradient"`` or ``"black_box"``.
      num_canaries: canaries per training.
      trainings: number of trainings.
      sampling_probability: Poisson rate ``q`` of the trainings.
      scores, included: every canary's score and inclusion (all trainings, in order).
      minutes: wall-clock minutes of the audit.
      score: how the white-box score was computed (``"likelihood ratio"`` of the per-step updates
        or ``"sum"`` of the updates) or ``"loss"`` (black-box).
      updates: white-box: each canary's coordinate update at every step (raw weight units),
        shape ``[canaries, steps]``; None for black-box.
      profile: ``white_box_gradient``: the test of the whole certified privacy profile
        (:class:`tf_dp.auditing.profile.ProfileTest`; counted in :attr:`violation`), else None.
      power: ``white_box_gradient``: the smallest violation this budget detects with
        probability 0.9 (:class:`PowerCalculation`), else None.
    """

    certified: PrivacyResult
    one_run: one_run.OneRunBound
    many_run: Optional[many_run.ManyRunBound]
    gdp_bound: Optional[gaussian.GaussianEstimate]
    gdp_estimate: Optional[gaussian.GaussianEstimate]
    threat_model: str
    num_canaries: int
    trainings: int
    sampling_probability: float
    scores: np.ndarray = dataclasses.field(repr=False)
    included: np.ndarray = dataclasses.field(repr=False)
    minutes: float = 0.0
    score: str = "sum"
    updates: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)
    profile: Optional[profile.ProfileTest] = None
    power: Optional[PowerCalculation] = None

    @property
    def bounds(self) -> list:
        """The report's statistical statements (one-run, many-run, GDP bound, certified-profile
        test; those computed): their error levels add up to ``1 -`` :attr:`confidence`."""
        return [b for b in (self.one_run, self.many_run, self.gdp_bound, self.profile)
                if b is not None]

    @property
    def confidence(self) -> float:
        """Probability that all of the report's lower bounds hold at once: ``1 -`` the sum of
        their error levels (Bonferroni), so also the confidence of :attr:`lower_bound` and
        :attr:`violation`. :func:`audit_dp_sgd` splits its ``confidence`` so that this is it
        (up to rounding); bounds each computed at 95% would give 90% (two) or 85% (three)."""
        # rounded to 1e-12, so that 1 - 3 x (0.05 / 3) reads 0.95
        return max(0.0, round(1.0 - math.fsum(1.0 - b.confidence for b in self.bounds), 12))

    @property
    def lower_bound(self) -> float:
        """The largest ``(eps, delta)`` lower bound that needs no assumption on the mechanism,
        valid with probability :attr:`confidence`."""
        bounds = [self.one_run.epsilon]
        if self.many_run is not None:
            bounds.append(self.many_run.epsilon)
        return max(bounds)

    @property
    def violation(self) -> bool:
        """True when a measured bound exceeds the certified epsilon (the certificate is wrong).

        Counts :attr:`lower_bound`, the GDP bound for full-batch runs, where DP-SGD is exactly
        Gaussian-DP, and (``white_box_gradient``) the certified-profile test, which flags an
        attack that breaks the certificate at any of its ``(eps(delta), delta)`` pairs. A correct
        certificate is reported violated with probability at most ``1 -`` :attr:`confidence`.
        """
        if self.profile is not None and self.profile.violated:
            return True
        measured = self.lower_bound
        if self.gdp_bound is not None and self.sampling_probability == 1.0:
            measured = max(measured, self.gdp_bound.epsilon)
        return measured > self.certified.epsilon

    def sees(self) -> str:
        """What this audit can and cannot see: its threat model, in words.

        Example::

            print(report.sees())
        """
        if self.threat_model == "black_box":
            return ("sees the final model's loss on mislabeled input canaries; cannot see the "
                    "iterates, so a defect that the final model hides (e.g. noise that later "
                    "steps wash out) goes unseen; canaries share one model (one-run bound only)")
        text = ("sees every iterate of the canary coordinates (white-box: the adversary crafts "
                "a gradient of norm >= the clip on a coordinate the data never touch), so it "
                "sees the noise, the clipping and the sampling of the DP step as it ran; cannot "
                "see what the canary coordinates do not: the data's own gradients, defects that "
                "act only on other coordinates or other parameter groups, or the accountant's "
                "arithmetic beyond the certificate it compares with")
        if self.power is not None:
            text += f"; {self.power}"
        return text

    def summary(self) -> dict:
        """The report's figures as a dict of JSON values (no scores), as :meth:`save` writes them.

        Example::

            report.summary()["lower_bound"]
        """
        c = self.certified
        bounds = {"one_run": dataclasses.asdict(self.one_run)}
        if self.many_run is not None:
            bounds["many_run"] = dataclasses.asdict(self.many_run)
        if self.gdp_bound is not None:
            bounds["gdp_bound"] = dataclasses.asdict(self.gdp_bound)
        if self.gdp_estimate is not None:
            bounds["gdp_estimate"] = dataclasses.asdict(self.gdp_estimate)
        if self.profile is not None:
            bounds["profile_test"] = dataclasses.asdict(self.profile)
        return {
            "lower_bound": float(self.lower_bound), "delta": float(self.one_run.delta),
            "confidence": float(self.confidence),
            "confidence_note": self._confidence_note(),
            "certified_epsilon": float(c.epsilon), "certified_accountant": c.accountant,
            "certified_is_guarantee": bool(c.certified and not c.noise_seeds),
            "violation": bool(self.violation), "threat_model": self.threat_model,
            "score": self.score, "num_canaries": self.num_canaries, "trainings": self.trainings,
            "sampling_probability": self.sampling_probability, "minutes": self.minutes,
            "sees": self.sees(),
            "smallest_detectable": (None if self.power is None
                                    else dataclasses.asdict(self.power)),
            **bounds,
        }

    def save(self, path: str) -> None:
        """Writes :meth:`summary` as JSON (``compute_dp_sgd_privacy --audit_report=PATH`` prints it
        beside a ledger's analysis).

        Example::

            report.save("audit.json")
        """
        from tf_dp.auditing.report_file import write_report_file

        write_report_file(path, self.summary())

    def _confidence_note(self) -> str:
        levels = sorted({b.confidence for b in self.bounds})
        if len(self.bounds) == 1:
            return f"one bound, at {_percent(self.confidence)} confidence"
        each = " / ".join(_percent(c) for c in levels)
        return (f"{len(self.bounds)} bounds, each at {each} confidence, hold together at "
                f"{_percent(self.confidence)} (Bonferroni): so do the lower bound and the "
                "violation check")

    def __str__(self) -> str:
        c = self.certified
        seeded = " (seeded noise: no guarantee, the figure an unseeded run would get)" if (
            c.noise_seeds) else ""
        how = ("the likelihood ratio of the sampled Gaussian mechanism, summed over the per-step "
               "updates" if self.score == "likelihood ratio" else "the sum of the per-step updates")
        threat = (f"{self.threat_model.replace('_', '-')}: Dirac gradient canaries, every "
                  f"iterate visible (score: {how} on the canary's coordinate)"
                  if self.threat_model != "black_box" else
                  "black-box: mislabeled input canaries, final model only (score: minus the loss)")
        lines = [
            f"Privacy audit ({self.trainings} training(s) x {self.num_canaries} canaries, each "
            f"included with probability 1/2; Poisson rate q = {self.sampling_probability:g}; "
            f"{self.minutes:.1f} min)",
            f"  threat model: {threat}",
            f"  it {self.sees()}",
            f"  certified [{c.accountant}]: epsilon = {c.epsilon:.3f} at delta = {c.delta:.3g}"
            f"{seeded}",
            f"  confidence: {self._confidence_note()}",
            f"  {self.one_run}",
        ]
        if self.many_run is not None:
            lines.append(f"  {self.many_run}")
        if self.gdp_bound is not None:
            lines.append(f"  {self.gdp_bound}")
        if self.gdp_estimate is not None:
            lines.append(f"  {self.gdp_estimate}")
        if self.profile is not None:
            lines.append(f"  {self.profile}")
        ratio = self.lower_bound / c.epsilon if c.epsilon > 0 else math.inf
        lines.append(f"  audited lower bound / certified = {ratio:.2f} "
                     f"({_percent(self.confidence)} confidence)")
        if self.violation:
            lines.append("  VIOLATION: a measured bound exceeds the certificate (its epsilon, or one "
                         "of its (eps, delta) pairs): the mechanism or its accounting is broken.")
        else:
            lines.append("  consistent: no measured bound exceeds the certified epsilon (an audit "
                         "can show a certificate wrong, never prove it right).")
        return "\n".join(lines)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


#: Most memory the arrays of a white-box audit may need (estimated by :func:`_audit_bytes`).
MAX_AUDIT_BYTES = 4 * 2**30


def _audit_bytes(m: int, n: int, q: float, steps: int) -> float:
    """Bytes a white-box audit with ``m`` canaries holds at once (an estimate): every step's
    batch (``q (n + m)`` rows expected, padded up to 3x) carries a one-hot canary code, its
    per-example gradient and their clipped copies (4 float32 arrays of ``rows x m``), and the
    canary weights traced after every step (float64, ``(steps + 1) x m``, 3 copies)."""
    rows = min(3.0 * q, 1.0) * (n + m) + 1.0
    return 16.0 * rows * m + 24.0 * (steps + 1) * m


def _check_audit_size(m: int, n: int, q: float, steps: int) -> None:
    """ValueError naming ``num_canaries`` (or ``steps``) and its range if the audit's arrays
    would need more than :data:`MAX_AUDIT_BYTES`, before anything is allocated."""
    if _audit_bytes(m, n, q, steps) <= MAX_AUDIT_BYTES:
        return
    budget = f"{MAX_AUDIT_BYTES / 2**30:g} GiB"
    if _audit_bytes(2, n, q, steps) > MAX_AUDIT_BYTES:
        most = int((MAX_AUDIT_BYTES - 32.0 * (min(3.0 * q, 1.0) * (n + 2) + 1.0)) / 48.0) - 1
        raise ValueError(
            f"steps must be in [1, {max(most, 0)}] for an audit of {n} rows at "
            f"sampling_probability={q!r}, got {steps}: its traced canary weights would need "
            f"more than {budget}"
        )
    lo, hi = 2, m  # the largest accepted count, by bisection (the estimate grows with m)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _audit_bytes(mid, n, q, steps) <= MAX_AUDIT_BYTES else (lo, mid)
    raise ValueError(
        f"num_canaries must be in [2, {lo}] for an audit of {n} rows at "
        f"sampling_probability={q!r} over {steps} steps, got {m}: its arrays would need about "
        f"{_audit_bytes(m, n, q, steps) / 2**30:.3g} GiB (batch rows x canaries per step, "
        f"steps x canaries traced; at most {budget})"
    )


def _default_canary_norm(optimizer) -> float:
    clip = optimizer.get_config().get("l2_norm_clip")
    if not isinstance(clip, (int, float)) or isinstance(clip, bool):
        raise ValueError(
            "canary_gradient_norm is needed when the optimizer's l2_norm_clip is not a number "
            f"(got {clip!r}); pass a norm >= the largest clip"
        )
    return 10.0 * float(clip)


def _white_box_model(model_fn, x, y, loss, num_canaries, norm):
    base = model_fn()
    x_in = keras.Input(shape=x.shape[1:], dtype=str(x.dtype), name="x")
    y_in = keras.Input(shape=y.shape[1:], dtype=str(y.dtype), name="y")
    id_in = keras.Input(shape=(), dtype="int32", name="canary_id")
    out = CanaryHead(num_canaries, loss, norm, name="canary_head")([base(x_in), y_in, id_in])
    return keras.Model({"x": x_in, "y": y_in, "canary_id": id_in}, out)


class _CanaryTrace(keras.callbacks.Callback):
    """Reads the canary coordinates after every step, and the learning rate each step used."""

    def __init__(self, head: CanaryHead):
        super().__init__()
        self._head = head
        self.weights: list = []
        self.learning_rates: list = []

    def on_train_batch_begin(self, batch, logs=None):
        lr = self.model.optimizer.learning_rate
        self.learning_rates.append(float(keras.ops.convert_to_numpy(lr)))

    def on_train_batch_end(self, batch, logs=None):
        weights = keras.ops.convert_to_numpy(self._head.canary_weights)
        self.weights.append(np.array(weights, dtype=np.float64))


def _configured_sigma(optimizer) -> Optional[float]:
    """The noise multiplier when the optimizer is plain SGD on the Gaussian query with numbers for
    clip and noise (the per-step updates are then ``Bernoulli(q) + N(0, sigma^2)`` clip units);
    None otherwise (the white-box score falls back to the sum of the updates)."""
    config = optimizer.get_config()

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

    if (not isinstance(optimizer, keras.optimizers.SGD) or config.get("momentum")
            or config.get("dp_sum_query") is not None or config.get("num_microbatches")
            or not number(config.get("l2_norm_clip"))):
        return None
    if number(config.get("noise_stddev")):
        return float(config["noise_stddev"]) / float(config["l2_norm_clip"])
    if number(config.get("noise_multiplier")):
        return float(config["noise_multiplier"])
    return None


def _reference_scores(q: float, sigma: float, steps: int, rng: np.random.Generator,
                      true_sigma: Optional[float] = None, n: int = 100_000):
    """Dirac scores simulated from the configured mechanism (or, with ``true_sigma``, from the
    same run with that noise multiplier), scored as the audit scores them: (in, out)."""
    n = max(2, min(n, 20_000_000 // steps))
    scale = sigma if true_sigma is None else true_sigma
    noise_in, noise_out = scale * rng.normal(size=(2, n, steps))
    sampled = rng.random((n, steps)) < q
    return dirac_score(sampled + noise_in, q, sigma), dirac_score(noise_out, q, sigma)


def _power(q, sigma, steps, thresholds, n_in, n_out, deltas, profile_eps, each, delta,
           accountant, certified, rng) -> PowerCalculation:
    """The smallest noise factor (on a grid) whose run the profile test flags w.p. >= 0.9."""
    from tf_dp.accounting import MIN_NOISE_MULTIPLIER, dp_sgd_epsilon

    factors = [f for f in np.geomspace(1.02, _MAX_FACTOR, 40)
               if sigma / f >= MIN_NOISE_MULTIPLIER]
    found = math.inf
    for f in factors:
        sim_in, sim_out = _reference_scores(q, sigma, steps, rng, sigma / f, n=20_000)
        tpr = np.array([(sim_in >= t).mean() for t in thresholds])
        fpr = np.array([(sim_out >= t).mean() for t in thresholds])
        if profile.detection_probability_bound(tpr, fpr, n_in, n_out, deltas, profile_eps,
                                               each, POWER_PROBABILITY):
            found = float(f)
            break
    eps = math.inf
    if math.isfinite(found):
        n = 10**6
        eps = dp_sgd_epsilon(n, max(1, round(q * n)), sigma / found, delta, steps=steps,
                             accountant=accountant).epsilon
    return PowerCalculation(POWER_PROBABILITY, found, sigma / found, float(eps),
                            float(certified), int(n_in), int(n_out))


def audit_dp_sgd(
    model_fn: Callable[[], keras.Model],
    optimizer_fn: Callable[[], keras.optimizers.Optimizer],
    x: np.ndarray,
    y: np.ndarray,
    *,
    loss: Any,
    sampling_probability: float = 1.0,
    steps: int = 10,
    num_canaries: int = 1000,
    trainings: int = 1,
    threat_model: str = "white_box",
    canary_gradient_norm: Optional[float] = None,
    num_classes: Optional[int] = None,
    delta: float = 1e-5,
    confidence: float = 0.95,
    accountant: str = "rdp",
    seed: Optional[int] = None,
) -> AuditReport:
    """Train ``trainings`` private models with canaries and audit them.

    Args:
      model_fn: builds a fresh (non-private) Keras model; it is made private here.
      optimizer_fn: builds a fresh tf_dp DP optimizer (its ledger gives the certified epsilon).
      x, y: real training data (numpy arrays, one row per example).
      loss: the Keras loss (name, function or ``keras.losses.Loss``).
      sampling_probability: Poisson rate ``q`` in (0, 1]; 1 is full-batch DP-SGD.
      steps: DP steps per training (one ``fit`` epoch of that many Poisson batches).
      num_canaries: canaries per training, ``m >= 2``.
      trainings: independent trainings; their canaries are pooled.
      threat_model: ``"white_box"`` (Dirac gradient canaries), ``"white_box_gradient"`` (the same
        canaries, every one a record, out-canaries with zero gradient; adds the test of the
        whole certified privacy profile and the power calculation; needs plain SGD with numbers
        for clip and noise) or ``"black_box"`` (mislabeled canaries: ``num_canaries`` rows of
        ``x`` are taken out of the real data, relabelled).
      canary_gradient_norm: white-box: the canary gradients' norm; default 10 x the optimizer's
        ``l2_norm_clip`` (clipping brings it to the clip; a broken clip lets it through).
      num_classes: black-box: number of classes of the integer labels ``y``.
      delta: the delta of every ``(eps, delta)`` figure, in (0, 1).
      confidence: probability, in (0, 1), that all the report's lower bounds hold together (so
        its ``lower_bound`` and ``violation``): each of the ``k`` bounds computed (one-run;
        many-run and the GDP bound when the trials are independent; the certified-profile test
        with ``white_box_gradient``) is at ``1 - (1 - confidence) / k``.
      accountant: for the certified epsilon (see ``tf_dp.accounting.compute_epsilon``).
      seed: canary inclusion, relabelling and Poisson sampling (None: OS entropy). The noise
        is the optimizer's (its own ``noise_seed``).

    Returns:
      An :class:`AuditReport`.
    """
    import tensorflow as tf  # noqa: F401  (the Keras backend)

    import tf_dp.keras as dpk
    from tf_dp.accounting.ledger_analysis import ACCOUNTANTS
    from tf_dp.data import poisson_batches

    if threat_model not in THREAT_MODELS:
        raise ValueError(f"threat_model must be one of {THREAT_MODELS}, got {threat_model!r}")
    q = sampling_probability
    if not (isinstance(q, (int, float)) and not isinstance(q, bool) and 0.0 < q <= 1.0):
        raise ValueError(f"sampling_probability must be in (0, 1], got {q!r}")
    steps = _positive_int("steps", steps)
    m = _positive_int("num_canaries", num_canaries)
    if m < 2:
        raise ValueError(f"num_canaries must be an integer >= 2, got {num_canaries!r}")
    trainings = _positive_int("trainings", trainings)
    delta = _checks.probability("delta", delta)
    confidence = _checks.probability("confidence", confidence)
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    x, y = np.asarray(x), np.asarray(y)
    if len(x) != len(y) or len(x) < 1:
        raise ValueError(
            f"x and y must have the same number of rows (>= 1), got {len(x)} and {len(y)}")
    if canary_gradient_norm is not None and not (
        isinstance(canary_gradient_norm, (int, float)) and math.isfinite(canary_gradient_norm)
        and canary_gradient_norm > 0
    ):
        raise ValueError(
            f"canary_gradient_norm must be a finite number > 0, got {canary_gradient_norm!r}")
    if threat_model != "black_box":  # (black_box: m < len(x), rows of x already in memory)
        _check_audit_size(m, len(x), float(q), steps)
    if threat_model == "black_box":
        if num_classes is None:
            raise ValueError("num_classes (an integer >= 2) is needed for black_box audits")
        if len(x) <= m:
            raise ValueError(
                f"black_box audits take num_canaries rows out of x: need len(x) > num_canaries "
                f"({len(x)} <= {m})")

    rng = np.random.default_rng(seed)
    start = time.time()
    scores, included, certificates, updates, ledgers = [], [], [], [], []
    sigmas = set()
    white = threat_model in ("white_box", "white_box_gradient")
    # minutes of training: progress lines past 5 s (tf_dp.set_progress)
    for _ in counted(range(trainings), f"audit_dp_sgd: training {trainings} models"):
        inc = draw_inclusion(m, rng)
        optimizer = optimizer_fn()
        from tf_dp.keras.optimizers import DPOptimizerMixin

        if not isinstance(optimizer, DPOptimizerMixin):
            raise TypeError(
                "optimizer_fn must return a tf_dp DP optimizer (e.g. "
                f"tf_dp.keras.DPKerasSGDOptimizer), got {type(optimizer).__name__}")
        batch_seed = int(rng.integers(0, 2**62))
        if threat_model == "white_box_gradient" and _configured_sigma(optimizer) is None:
            raise ValueError(
                "threat_model='white_box_gradient' needs optimizer_fn to build plain SGD "
                "(no momentum, no microbatches, no dp_sum_query) with numbers for l2_norm_clip "
                "and noise_multiplier (or noise_stddev) > 0: its thresholds and power come from "
                f"a simulation of that mechanism; got {type(optimizer).__name__} with "
                f"{ {k: optimizer.get_config().get(k) for k in ('l2_norm_clip', 'noise_multiplier')} }")
        if white:
            norm = (canary_gradient_norm if canary_gradient_norm is not None
                    else _default_canary_norm(optimizer))
            model = dpk.make_private(_white_box_model(model_fn, x, y, loss, m, norm))
            model.compile(optimizer=optimizer, loss=per_example_output_loss)
            # white_box: the included canaries are records; white_box_gradient: every canary is
            # a record and an excluded one has weight 0 (a zero gradient: the add/remove
            # neighbour), so the population and the public denominator q n do not depend on
            # the coins and the canaries' scores are exactly independent
            every = threat_model == "white_box_gradient"
            ids = np.arange(m) if every else np.flatnonzero(inc)
            k = len(ids)
            feats = {
                "x": np.concatenate([x, np.zeros((k,) + x.shape[1:], x.dtype)]),
                "y": np.concatenate([y, np.zeros((k,) + y.shape[1:], y.dtype)]),
                "canary_id": np.concatenate(
                    [np.full(len(x), -1, np.int32), ids.astype(np.int32)]),
            }
            targets = np.zeros(len(x) + k, np.float32)
            weight = (np.concatenate([np.ones(len(x)), inc]).astype(np.float32) if every
                      else None)
            head = model.get_layer("canary_head")
            batches = poisson_batches(feats, targets, sampling_probability=q,
                                      sample_weight=weight, steps_per_epoch=steps,
                                      seed=batch_seed)
            trace = _CanaryTrace(head)
            model.fit(batches, epochs=1, verbose=0, callbacks=[trace])
            weights = np.stack([np.zeros(m)] + trace.weights)
            step_updates = np.diff(weights, axis=0).T  # [canaries, steps]
            sigma = _configured_sigma(optimizer)
            sigmas.add(sigma)
            if sigma is None:
                scores.append(step_updates.sum(axis=1))
            else:
                # one clipped canary's update: lr C / (q n), with n the expected population
                # (a constant: it must not depend on the other canaries' coins)
                clip = float(optimizer.get_config()["l2_norm_clip"])
                population = len(x) + (m if every else m / 2)
                unit = np.asarray(trace.learning_rates) * clip / (q * population)
                scores.append(dirac_score(step_updates / unit, q, sigma))
            updates.append(step_updates)
        else:
            order = rng.permutation(len(x))
            pool, real = order[:m], order[m:]
            x_c, y_c = mislabeled_canaries(x[pool], y[pool], num_classes, rng)
            model = dpk.make_private(model_fn())
            model.compile(optimizer=optimizer, loss=loss)
            x_train = np.concatenate([x[real], x_c[inc]])
            y_train = np.concatenate([y[real], y_c[inc]])
            batches = poisson_batches(x_train, y_train, sampling_probability=q,
                                      steps_per_epoch=steps, seed=batch_seed)
            model.fit(batches, epochs=1, verbose=0)
            per_example = CanaryHead(1, loss, 1.0)._loss_fn
            pred = model.predict(x_c, verbose=0)
            scores.append(-np.asarray(keras.ops.convert_to_numpy(per_example(y_c, pred)),
                                      np.float64))
        included.append(inc)
        certificates.append(compute_epsilon(optimizer.ledger, delta, accountant))
        ledgers.append(optimizer.ledger)
    s, inc = np.concatenate(scores), np.concatenate(included)
    certified = max(certificates, key=lambda r: r.epsilon)
    independent = white or m == 1
    pooled = independent and inc.sum() >= 2 and (~inc).sum() >= 2
    white_sigma = next(iter(sigmas)) if white and len(sigmas) == 1 else None
    tight = threat_model == "white_box_gradient" and pooled and white_sigma is not None
    # Bonferroni: the k lower bounds (and the profile test) share 1 - confidence, so that they
    # (and their maximum, the report's lower_bound and violation) hold together at `confidence`
    each = 1.0 - (1.0 - confidence) / ((4 if tight else 3) if pooled else 1)
    one = one_run.epsilon_lower_bound(s, inc, delta, each)
    many = gdp_lb = gdp_est = prof = power = None
    if pooled:
        thresholds = None
        if white_sigma is not None:
            ref_in, ref_out = _reference_scores(q, white_sigma, updates[0].shape[1], rng)
            thresholds = [many_run.design_threshold(ref_in, ref_out, int(inc.sum()),
                                                    int((~inc).sum()), delta, each)]
        many = many_run.epsilon_lower_bound(s, inc, delta, each, thresholds=thresholds)
        gdp_lb = gaussian.mu_lower_bound(s, inc, each, delta)
    if tight:
        # the certificate at every delta of the grid (the largest over the trainings: each
        # canary is in one training), thresholds from the configured mechanism, fixed before
        # the audited scores are looked at
        deltas = profile.profile_deltas(delta)
        profile_eps = np.array([max(compute_epsilon(led, float(d), accountant).epsilon
                                    for led in ledgers) for d in deltas])
        steps_run = updates[0].shape[1]
        _, ref_out = _reference_scores(q, white_sigma, steps_run, rng)
        levels = profile.design_thresholds(ref_out)
        prof = profile.profile_test(s, inc, deltas, profile_eps, each, thresholds=levels)
        power = _power(q, white_sigma, steps_run, levels, int(inc.sum()), int((~inc).sum()),
                       deltas, profile_eps, each, delta, accountant, certified.epsilon, rng)
    all_updates = None
    if white:
        all_updates = np.concatenate(updates)
        gdp_est = gaussian.mu_estimate(all_updates.sum(axis=1), inc, confidence, delta)
    score = ("loss" if threat_model == "black_box" else
             "likelihood ratio" if white_sigma is not None and q < 1 else "sum")
    return AuditReport(certified, one, many, gdp_lb, gdp_est, threat_model, m, trainings,
                       float(q), s, inc, (time.time() - start) / 60.0, score, all_updates,
                       prof, power)
