"""research/correlated_noise/compare.py's accounting: the Gaussian mechanism's epsilon against
dp_accounting, and the sensitivities against closed forms (no training)."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "compare_correlated", ROOT / "research" / "correlated_noise" / "compare.py"
)
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
def test_gaussian_epsilon_matches_dp_accounting(mu):
    eps = compare.gaussian_epsilon(mu, 1e-5)
    # dp_accounting's PLD of the same mechanism: pessimistic, so at or above the exact value, by
    # at most a few times its discretisation (1e-4 here)
    ref = pld.from_gaussian_mechanism(
        1.0 / mu, sensitivity=1.0, value_discretization_interval=1e-4
    ).get_epsilon_for_delta(1e-5)
    assert eps <= ref <= eps + 1e-2
    assert compare.mu_for(eps, 1e-5) == pytest.approx(mu, rel=1e-6)


def test_sensitivities_match_closed_forms():
    n, parts, bands = 48, 6, 6
    # DP-SGD: k = n / parts participations, sqrt(k)
    assert compare.sensitivity(np.eye(n), parts) == pytest.approx(math.sqrt(n / parts), rel=1e-12)
    # banded, bands <= parts: one record's columns have disjoint supports, batch 0's all full
    coef, c = compare.banded_sqrt(n, bands)
    r = [math.comb(2 * j, j) / 4**j for j in range(bands)]
    want = math.sqrt(n / parts * sum(x * x for x in r))
    assert compare.sensitivity(c, parts) == pytest.approx(want, rel=1e-12)
    # the recurrence's coef is C's bands
    for t in range(n):
        for j in range(bands):
            assert coef[t, j] == (c[t, t - j] if t - j >= 0 else 0.0)
    # the banded square root (all bands) squares to the prefix-sum matrix
    _, full = compare.banded_sqrt(n, n)
    np.testing.assert_allclose(full @ full, np.tril(np.ones((n, n))), atol=1e-12)


@pytest.mark.parametrize("parts,epochs", [(8, 5), (6, 3)])
def test_tree_sensitivity_is_sqrt_of_epochs_times_tree_depth(parts, epochs):
    """One tree per epoch, a record once per epoch at the same position: it lies in
    floor(log2 b) + 1 nodes of each epoch's tree (0/1 sums: exact)."""
    from tf_dp.correlated.strategies import TreeStrategy

    c = np.kron(np.eye(epochs), TreeStrategy(parts).matrix())
    want = math.sqrt(epochs * (math.floor(math.log2(parts)) + 1))
    assert compare.sensitivity(c, parts) == pytest.approx(want, rel=1e-12)


def test_text_task_bag_of_words_features():
    """Each row: the words present (repeats and padding ignored), scaled to unit norm."""
    ids = np.array([[2, 3, 3, 0], [4, 0, 0, 0], [0, 0, 0, 0]], dtype=np.int32)
    f = compare.bag_of_words(ids, 6)
    np.testing.assert_allclose(f[0], [0, 0, 1 / math.sqrt(2), 1 / math.sqrt(2), 0, 0])
    np.testing.assert_allclose(f[1], [0, 0, 0, 0, 1, 0])
    np.testing.assert_allclose(f[2], 0.0)  # an empty text: no features, no division by zero
