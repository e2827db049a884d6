"""User-level truncated Poisson and balls-in-bins batches (arrays and random-access sources):
inclusion statistics per user against theory (fixed seeds; binomial / chi-square tolerances at
rejection level 1e-4, Bonferroni-corrected), the slot layout, the ledger's claim, epsilon against
an independent computation of the same mechanism with n = users, per-user clipping against a
per-user GradientTape loop in a custom loop (DPTrainStep)."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp
from scipy import optimize, special, stats

import tf_dp
from tests.helpers.tolerance import dense_gradient_terms, norm_terms, sgd_tolerance
from tf_dp.accounting import compute_epsilon
from tf_dp.accounting import rdp as tf_rdp
from tf_dp.data import (
    ArraySource,
    balls_in_bins_batches,
    balls_in_bins_sample,
    truncated_poisson_batches,
    truncated_poisson_sample,
)

LEVEL = 1e-4  # rejection level of every statistical check in this file
DELTA = 1e-5
PLD_REL = 5e-3  # the PLD accountant's stated discretisation slack (tests of accounting.pld)

# 30 users with 1..5 records each (user u has 1 + u % 5), ids shuffled over the records
COUNTS = 1 + np.arange(30) % 5
USER_OF = np.random.default_rng(0).permutation(np.repeat(np.arange(30) * 7 + 100, COUNTS))
N_USERS, N_RECORDS, K = 30, int(COUNTS.sum()), 2


def _data():
    x = np.arange(N_RECORDS, dtype=np.float32)[:, None]
    return x, np.zeros(N_RECORDS, np.int32)


def _slots(batch, k):
    """``[(user id, [record, ...]), ...]`` of a user-level batch (padding slots left out), after
    checking that padding rows have weight 0 and every slot's rows are one user's records."""
    xb, _, w = (np.asarray(t) for t in batch)
    assert xb.shape[0] % k == 0
    out = []
    for s in range(xb.shape[0] // k):
        real = w[s * k:(s + 1) * k] > 0
        recs = xb[s * k:(s + 1) * k, 0][real].astype(int)
        assert np.all(xb[s * k:(s + 1) * k, 0][~real] == 0)
        if len(recs) == 0:
            continue
        owners = set(USER_OF[recs].tolist())
        assert len(owners) == 1, owners  # one user per slot
        assert len(set(recs.tolist())) == len(recs)  # distinct records
        user = owners.pop()
        assert len(recs) == min(k, COUNTS[(user - 100) // 7])  # min(k, c) records
        out.append((user, recs))
    users = [u for u, _ in out]
    assert len(set(users)) == len(users)  # a user in at most one slot
    return out


def _binomial_ok(count, trials, p, tests):
    """Two-sided binomial test at LEVEL / tests (Bonferroni)."""
    lo, hi = stats.binom.ppf(LEVEL / tests / 2, trials, p), stats.binom.isf(
        LEVEL / tests / 2, trials, p)
    return lo <= count <= hi


def _chisquare_ok(observed, expected):
    obs, exp, o_acc, e_acc = [], [], 0.0, 0.0
    for o, e in zip(observed, expected):
        o_acc, e_acc = o_acc + o, e_acc + e
        if e_acc >= 5:
            obs.append(o_acc)
            exp.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc > 0:
        obs[-1] += o_acc
        exp[-1] += e_acc
    return stats.chisquare(obs, exp).pvalue > LEVEL


def _check_truncated_statistics(batches, steps, q, b):
    sizes = np.zeros(N_USERS + 1)
    included = {u: 0 for u in np.unique(USER_OF)}
    picked = {}  # (user, record) -> times kept, for users with more than k records
    for batch in batches:
        slots = _slots(batch, K)
        sizes[len(slots)] += 1
        for user, recs in slots:
            included[user] += 1
            for r in recs:
                picked[(user, r)] = picked.get((user, r), 0) + 1
    assert sizes.sum() == steps
    # users per batch: min(Binomial(n_users, q), B)
    pmf = stats.binom.pmf(np.arange(N_USERS + 1), N_USERS, q)
    law = np.zeros(N_USERS + 1)
    law[:b] = pmf[:b]
    law[b] = pmf[b:].sum()
    assert _chisquare_ok(sizes, steps * law)
    # each user kept with probability E[min(K, B)] / n_users (symmetry)
    p_user = float(np.arange(N_USERS + 1) @ law) / N_USERS
    assert all(_binomial_ok(c, steps, p_user, N_USERS) for c in included.values()), included
    # a kept user's record: chosen with probability k / c given the user is kept
    tests = sum(int(c) for c in COUNTS if c > K)
    for (user, _), c in picked.items():
        count = COUNTS[(user - 100) // 7]
        if count > K:
            assert _binomial_ok(c, included[user], K / count, tests)


def test_truncated_poisson_users_inclusion_matches_theory():
    x, y = _data()
    q, b, steps = 0.2, 7, 2000  # P[Binomial(30, 0.2) > 7] = 0.24: truncation is frequent
    made = truncated_poisson_batches(x, y, sampling_probability=q, max_batch_size=b,
                                     steps_per_epoch=steps, seed=5, user_ids=USER_OF,
                                     max_records_per_user=K)
    s = made.sampling
    assert (s.policy, s.unit, s.records_per_unit, s.max_batch_size, s.population_size,
            s.selection_probability, s.origin) == (
        "truncated_poisson", "user", K, b, N_USERS, q, "sampled")
    assert made.steps_per_epoch == steps
    shapes = set()

    def batches():
        for xb, yb, w in made.dataset:
            shapes.add(tuple(xb.shape))
            yield xb.numpy(), yb.numpy(), w.numpy()

    _check_truncated_statistics(batches(), steps, q, b)
    assert shapes == {(b * K, 1)}  # one shape: B slots of k rows


def test_truncated_poisson_sample_users_from_a_source():
    x, y = _data()
    q, b, steps = 0.2, 7, 1500
    made = truncated_poisson_sample(ArraySource(x, y), sampling_probability=q, max_batch_size=b,
                                    steps_per_epoch=steps, seed=6, user_ids=USER_OF,
                                    max_records_per_user=K)
    assert made.sampling == truncated_poisson_batches(
        x, y, sampling_probability=q, max_batch_size=b, user_ids=USER_OF,
        max_records_per_user=K).sampling
    _check_truncated_statistics(made.dataset.as_numpy_iterator(), steps, q, b)


@pytest.mark.parametrize("from_source", [False, True], ids=["arrays", "source"])
def test_balls_in_bins_users_every_user_once_per_pass_in_a_uniform_bin(from_source):
    x, y = _data()
    t, passes = 5, 60 if not from_source else 40
    if from_source:
        made = balls_in_bins_sample(ArraySource(x, y), num_batches=t, seed=7, user_ids=USER_OF,
                                    max_records_per_user=K)
    else:
        made = balls_in_bins_batches(x, y, num_batches=t, seed=7, user_ids=USER_OF,
                                     max_records_per_user=K)
    s = made.sampling
    assert (s.policy, s.unit, s.records_per_unit, s.population_size, s.selection_probability) == (
        "balls_in_bins", "user", K, N_USERS, 1 / t)
    sizes = np.zeros(N_USERS + 1)
    bin_of = np.zeros((N_USERS, t))
    ids = np.unique(USER_OF)
    for _ in range(passes):  # each iteration of the dataset is one pass (a fresh assignment)
        seen = []
        for step, batch in enumerate(made.dataset.as_numpy_iterator()):
            slots = _slots(batch, K)
            sizes[len(slots)] += 1
            for user, _ in slots:
                bin_of[np.searchsorted(ids, user), step] += 1
            seen += [u for u, _ in slots]
        assert step == t - 1
        assert sorted(seen) == sorted(ids.tolist())  # every user exactly once per pass
    # users per batch: Binomial(n_users, 1 / T); a user's batch: uniform over the T steps
    assert _chisquare_ok(sizes, passes * t * stats.binom.pmf(np.arange(N_USERS + 1), N_USERS,
                                                             1 / t))
    assert all(stats.chisquare(row).pvalue > LEVEL / N_USERS for row in bin_of)


# --- the ledger, the accounting and the per-user clipping, through fit and DPTrainStep ---

CLIP, LR = 0.5, 0.5


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((1,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)
    ])


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _xy():
    x = (np.arange(N_RECORDS, dtype=np.float32)[:, None] / N_RECORDS) * 4.0 - 2.0
    return x, (np.arange(N_RECORDS) % 3).astype(np.int32)


def _truncated_rdp_epsilon(n, q, b, z, steps):
    """The truncated mechanism's RDP bound from dp_accounting's subsampled-Gaussian curves
    (independent code): w and a from direct binomial sums, the worse neighbour."""
    orders = np.asarray(tf_rdp.DEFAULT_ORDERS, dtype=np.float64)
    worst = 0.0
    for m in (n - 1, n):
        k = np.arange(b, m + 1)
        pmf = stats.binom.pmf(k, m, q)
        w = pmf.sum()
        a = (pmf * q * b / (k + 1)).sum() / w
        r_plain = dpa_rdp._compute_rdp_poisson_subsampled_gaussian(q, z, orders)
        r_swap = dpa_rdp._compute_rdp_poisson_subsampled_gaussian(a, z / 2, orders)
        mix = special.logsumexp(
            [(orders - 1) * r_plain, (orders - 1) * r_swap], axis=0, b=[[1 - w], [w]]
        ) / (orders - 1)
        worst = max(worst, dpa_rdp.compute_epsilon(orders, steps * mix, DELTA)[0])
    return worst


def _gaussian_epsilon(mu, delta):
    """Exact epsilon of the Gaussian mechanism (Balle & Wang 2018)."""
    def f(eps):
        return (stats.norm.cdf(mu / 2 - eps / mu)
                - math.exp(eps) * stats.norm.cdf(-mu / 2 - eps / mu) - delta)
    return optimize.brentq(f, 0.0, 100.0, xtol=1e-12)


def test_fit_on_user_level_selections_records_users_and_charges_the_mechanism_over_users():
    x, y = _xy()
    z, q, b = 1.0, 0.2, 7
    for made in (
        truncated_poisson_batches(x, y, sampling_probability=q, max_batch_size=b, seed=1,
                                  user_ids=USER_OF, max_records_per_user=K),
        balls_in_bins_batches(x, y, batch_size=6, seed=1, user_ids=USER_OF,
                              max_records_per_user=K),
    ):
        model = tf_dp.keras.make_private(_model())
        model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=CLIP, noise_multiplier=z, learning_rate=LR, noise_seed=0), loss=_loss())
        model.fit(made, epochs=2, verbose=0)
        entries = model.optimizer.ledger.samples()
        assert len(entries) == 2 * made.steps_per_epoch
        for e in entries:
            s = e.sampling
            assert (s.unit, s.records_per_unit, s.population_size, s.origin) == (
                "user", K, N_USERS, "sampled")
            assert s.policy == made.sampling.policy
        if made.sampling.policy == "truncated_poisson":
            assert {e.sampling.max_batch_size for e in entries} == {b}
            got = compute_epsilon(model.optimizer.ledger, DELTA, "rdp").epsilon
            # the record-level truncated mechanism with n = users, q, B (independent code)
            assert got == pytest.approx(
                _truncated_rdp_epsilon(N_USERS, q, b, z, len(entries)), rel=1e-6)
        else:
            assert [e.sampling.pass_start for e in entries] == ([True] + [False] * 4) * 2
            got = compute_epsilon(model.optimizer.ledger, DELTA, "pld").epsilon
            exact = _gaussian_epsilon(math.sqrt(2) / z, DELTA)  # 2 epochs over users: C each
            assert exact <= got <= exact * (1 + PLD_REL)


# one noiseless step by hand vs DPTrainStep: float32 tolerance of the 1-4-3 model's per-example
# gradients, a user's sum of k = 2, the norm over 23 parameters, the sum of <= 14 rows, a division
ATOL = sgd_tolerance("float32", steps=1, learning_rate=LR, update_scale=CLIP,
                     terms=dense_gradient_terms([1, 4, 3]) + K + norm_terms(23) + 14 + 1,
                     weight_scale=1.5)


def _by_hand(weights, xb, yb, wb, sampling):
    """A GradientTape per user slot (k rows, weighted), the slot's gradient clipped to CLIP,
    summed, divided by the public q * n_users, one SGD step."""
    model = _model()
    model.set_weights(weights)
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for start in range(0, len(xb), K):
        sl = slice(start, start + K)
        if not np.any(wb[sl] > 0):
            continue
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(_loss().call(yb[sl], model(xb[sl])) * wb[sl])
        grads = [g.numpy().astype(np.float64)
                 for g in tape.gradient(value, model.trainable_variables)]
        scale = min(1.0, CLIP / np.sqrt(sum(np.sum(g * g) for g in grads)))
        total = [t + scale * g for t, g in zip(total, grads)]
    denominator = sampling.population_size * sampling.selection_probability
    return [w - LR * t / denominator for w, t in zip(weights, total)]


@pytest.mark.parametrize("policy", ["truncated_poisson", "balls_in_bins"])
def test_custom_loop_dp_train_step_on_both_selections(policy):
    """DPTrainStep on user-level batches of both selections: each step's update is the per-user
    clipped sum over the public denominator (noise 0, vs a per-user GradientTape loop); with
    noise, the ledger holds one entry per step with the selection's claim, and its epsilon is the
    mechanism's (independent code). Eager steps: one trace of the step costs 40-90 s on the
    shared 2-core machine, and the traced DPTrainStep with user slots is tested in
    test_custom_loop.py (the selection changes only the declared Sampling)."""
    x, y = _xy()
    q, b, t = 0.2, 7, 5
    if policy == "truncated_poisson":
        made = truncated_poisson_batches(x, y, sampling_probability=q, max_batch_size=b,
                                         steps_per_epoch=3, seed=2, user_ids=USER_OF,
                                         max_records_per_user=K)
    else:
        made = balls_in_bins_batches(x, y, num_batches=t, seed=2, user_ids=USER_OF,
                                     max_records_per_user=K)
    # noiseless: the update against the hand computation, batch by batch
    model = _model()
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=0.0,
                                          learning_rate=LR)
    dp_step = tf_dp.keras.DPTrainStep(model, opt, _loss(), sampling=made.sampling)
    train = dp_step  # eager
    dp_step.start_pass()
    for xb, yb, wb in made.dataset.take(2):
        before = [w.copy() for w in model.get_weights()]
        train(xb, yb, wb)
        dp_step.flush()
        want = _by_hand(before, xb.numpy(), yb.numpy(), wb.numpy(), made.sampling)
        for got, ref in zip(model.get_weights(), want):
            np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL)
    # noisy: two passes (epochs) of steps, then the ledger and its epsilon
    z = 1.0
    model = _model()
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=z,
                                          learning_rate=LR, noise_seed=0)
    dp_step = tf_dp.keras.DPTrainStep(model, opt, _loss(), sampling=made.sampling)
    train = dp_step  # eager
    steps = 0
    for _ in range(2):
        dp_step.start_pass()
        for xb, yb, wb in made.dataset:
            train(xb, yb, wb)
            dp_step.flush()
            steps += 1
    entries = opt.ledger.samples()
    assert len(entries) == steps == 2 * made.steps_per_epoch
    assert {(e.sampling.policy, e.sampling.unit, e.sampling.population_size)
            for e in entries} == {(policy, "user", N_USERS)}
    if policy == "truncated_poisson":
        got = compute_epsilon(opt.ledger, DELTA, "rdp").epsilon
        assert got == pytest.approx(_truncated_rdp_epsilon(N_USERS, q, b, z, steps), rel=1e-6)
    else:
        got = compute_epsilon(opt.ledger, DELTA, "pld").epsilon
        exact = _gaussian_epsilon(math.sqrt(2) / z, DELTA)
        assert exact <= got <= exact * (1 + PLD_REL)
