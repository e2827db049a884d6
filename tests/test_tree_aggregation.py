"""Tree aggregation (Kairouz et al. 2021): the queries, their ledger events and their accounting.

Statistical checks use fixed seeds and tolerances of 6 standard errors from theory (a sample
variance of n i.i.d. normals has relative standard error sqrt(2 / n)).
"""

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_dp.accounting import compute_delta, compute_epsilon, gdp, rdp
from tf_dp.accounting import tree as tree_acc
from tf_dp.dp_query.tree_aggregation import (
    TreeCumulativeSumQuery,
    TreeResidualSumQuery,
    tree_depth,
)
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.ledger_file import (
    LedgerFileError,
    entries_to_payload,
    read_ledger_file,
    write_ledger_file,
)

D = 20000  # coordinates per draw: the sample of each statistical check
TOL = 6 * math.sqrt(2.0 / D)  # 6 standard errors of a relative sample variance


def _nodes(m):
    """The dyadic nodes (start, level) whose disjoint union is [1, m]."""
    out, start = set(), 0
    for level in reversed(range(m.bit_length())):
        if m >> level & 1:
            out.add((start, level))
            start += 1 << level
    return out


def _run(query, steps, values=None, seed_records=0):
    """Runs ``steps`` leaves of ``query`` on records of D coordinates; returns (outputs, exact
    leaf sums)."""
    rng = np.random.RandomState(seed_records)
    gs = query.initial_global_state()
    outs, leaves = [], []
    for _ in range(steps):
        x = rng.uniform(-1, 1, D).astype(np.float32) if values is None else values
        leaves.append(x)
        out, gs = query.get_noised_result(tf.constant(x), gs)
        outs.append(out.numpy().astype(np.float64))
    return outs, leaves, gs


def test_cumulative_sums_are_exact_sums_plus_tree_noise_of_documented_covariance():
    sigma = 0.7
    q = TreeCumulativeSumQuery(1e9, sigma, record_specs=tf.TensorSpec([D]), restart_every=15,
                               seed=11)
    outs, leaves, _ = _run(q, 15)
    noise = [o - np.cumsum(leaves, axis=0)[i] for i, o in enumerate(outs)]
    for i, z in enumerate(noise):
        m = i + 1
        expected = bin(m).count("1") * sigma**2  # popcount(m) nodes of variance sigma^2
        assert abs(z.mean()) < 6 * math.sqrt(expected / D)
        assert z.var() / expected == pytest.approx(1.0, abs=TOL)
    # nodes are shared between prefixes exactly as the tree says (covariance = sigma^2 x shared)
    for a, b in [(1, 2), (2, 3), (4, 5), (6, 7), (5, 7), (7, 15), (12, 14), (8, 9)]:
        shared = len(_nodes(a) & _nodes(b))
        cov = float(np.mean(noise[a - 1] * noise[b - 1]))
        sd = sigma**2 * math.sqrt(bin(a).count("1") * bin(b).count("1") / D)  # stderr bound
        assert abs(cov - shared * sigma**2) < 6 * sd, (a, b, shared, cov)


def test_residuals_sum_back_to_the_cumulative_sums_and_have_the_documented_variance():
    sigma = 1.3
    kw = dict(record_specs=tf.TensorSpec([D]), restart_every=6, seed=5)
    cum, leaves, _ = _run(TreeCumulativeSumQuery(1e9, sigma, **kw), 14)
    res, _, gs = _run(TreeResidualSumQuery(1e9, sigma, **kw), 14)
    total = np.zeros(D)
    for t in range(14):
        if t % 6 == 0:
            total = np.zeros(D)  # S_0 = 0 at each restart
        total = total + res[t]
        np.testing.assert_allclose(total, cum[t], atol=2e-4)
        m = t % 6 + 1
        l0 = (m & -m).bit_length() - 1
        z = res[t] - leaves[t]
        assert z.var() / ((1 + l0) * sigma**2) == pytest.approx(1.0, abs=TOL)
    assert int(gs.step) == 2 and gs.prefix == ()


def test_restarts_start_fresh_trees_and_the_spec_reports_the_leaf_index():
    q = TreeCumulativeSumQuery(10.0, 0.0, record_specs=[tf.TensorSpec([2])], restart_every=3)
    gs = q.initial_global_state()
    seen, outs = [], []
    for t in range(7):
        seen.append(int(q.sum_query_specs(gs)[0].tree_step))
        out, gs = q.get_noised_result([tf.constant([1.0, float(t)])], gs)
        outs.append(out[0].numpy())
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    assert [o[0] for o in outs] == [1, 2, 3, 1, 2, 3, 1]
    assert [o[1] for o in outs] == [0, 1, 3, 3, 7, 12, 6]
    gs = q.restart(gs)
    assert int(q.sum_query_specs(gs)[0].tree_step) == 0
    out, gs = q.get_noised_result([tf.constant([1.0, 1.0])], gs)
    assert out[0].numpy().tolist() == [1.0, 1.0]


def test_clipping_and_xla_compiled_steps():
    q = TreeResidualSumQuery(1.0, 0.5, record_specs=tf.TensorSpec([3]), restart_every=4, seed=2)
    params = q.derive_sample_params(q.initial_global_state())
    state = q.initial_sample_state(tf.zeros([3]))
    state = q.accumulate_record(params, state, tf.constant([3.0, 4.0, 0.0]))
    np.testing.assert_allclose(state.numpy(), [0.6, 0.8, 0.0], rtol=1e-6)

    @tf.function(jit_compile=True)
    def step(x, gs):
        return q.get_noised_result(x, gs)

    gs = q.initial_global_state()
    for t in range(6):
        out, gs = step(tf.zeros([3]), gs)
        assert out.shape == [3] and gs.nodes.shape == [3, 3]  # depth ceil(log2 5) = 3
    assert int(gs.step) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(restart_every=0), r"restart_every must be an integer in \[1, 2\*\*40 - 1\]"),
        (dict(restart_every=2.5), "restart_every must be an integer"),
        (dict(), "pass restart_every .* or max_depth"),
        (dict(max_depth=0), r"max_depth must be an integer in \[1, 40\]"),
        (dict(max_depth=41), r"max_depth must be an integer in \[1, 40\]"),
        (dict(restart_every=3, max_depth=2), "not both"),
    ],
)
def test_query_bad_arguments_name_the_argument_and_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TreeCumulativeSumQuery(1.0, 1.0, **kwargs)


def test_query_bad_clip_noise_and_missing_specs():
    with pytest.raises(ValueError, match="stddev must be a finite number >= 0"):
        TreeResidualSumQuery(1.0, -1.0, restart_every=2)
    with pytest.raises(ValueError, match="l2_norm_clip must be a finite number >= 0"):
        TreeResidualSumQuery(float("nan"), 1.0, restart_every=2)
    with pytest.raises(ValueError, match="needs record_specs"):
        TreeResidualSumQuery(1.0, 1.0, restart_every=2).initial_global_state()
    with pytest.raises(ValueError, match="fully defined"):
        TreeResidualSumQuery(1.0, 1.0, record_specs=tf.TensorSpec([None]), restart_every=2)


# -- accounting ------------------------------------------------------------------------------------

ORDERS = [1.25, 1.5, 2.0, 3.0, 4.5, 8.0, 16.0, 32.0, 64.0, 256.0]


@pytest.mark.parametrize("z", [0.3, 1.0, 2.7, 10.0])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 7, 8, 100, 1023, 1024, [3, 3, 2], [1, 16]])
@pytest.mark.parametrize("epochs", [1, 3, 20])
def test_tree_rdp_equals_dp_accounting(z, steps, epochs):
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rpa

    accountant = rpa.RdpAccountant(ORDERS, rpa.NeighborRel.REPLACE_SPECIAL)
    event = dp_event.SingleEpochTreeAggregationDpEvent(z, steps)
    accountant.compose(dp_event.SelfComposedDpEvent(event, epochs))
    ours = epochs * tree_acc.rdp_tree_aggregation(z, steps, ORDERS)
    np.testing.assert_allclose(ours, accountant._rdp, rtol=1e-12)
    assert dp_accounting is not None


def test_tree_depth_counts_released_levels():
    assert [tree_depth(t) for t in [1, 2, 3, 4, 7, 8, 15, 16]] == [1, 2, 2, 3, 3, 4, 4, 5]
    assert [tree_acc.tree_depth(t) for t in [0, 1, 1024]] == [0, 1, 11]


def _tree_ledger(n, batch, epochs, restart, z=2.0, clip=1.0, policy="shuffle", seed=None):
    spe = -(-n // batch)
    out, tree_step = [], 0
    for t in range(epochs * spe):
        if restart == "epoch":
            tree_step = t % spe
        elif restart is not None:
            tree_step = t % restart
        else:
            tree_step = t
        out.append(SampleEntry(
            SamplingEvent(n, batch / n, policy),
            (SumQueryEvent(clip, z * clip, "tree", noise_seed=seed, tree_step=tree_step),),
        ))
    return out


@pytest.mark.parametrize("z, n, batch, epochs", [(2.0, 1000, 100, 1), (1.1, 600, 50, 5),
                                                 (5.0, 1024, 64, 3)])
def test_ledger_epsilon_equals_direct_computation_restart_every_epoch(z, n, batch, epochs):
    entries = _tree_ledger(n, batch, epochs, "epoch", z)
    spe = -(-n // batch)
    # replace-one adjacency: leaf sensitivity 2C, i.e. noise multiplier z / 2 in the formula
    curve = epochs * tree_acc.rdp_tree_aggregation(z / 2, spe, rdp.DEFAULT_ORDERS)
    eps, order = rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, curve, 1e-5)
    res = compute_epsilon(entries, 1e-5, "rdp")
    assert res.epsilon == pytest.approx(eps, rel=1e-12) and res.order == order
    assert res.certified and "tree-aggregation" in res.assumptions
    assert "add/remove" not in res.assumptions
    # one Gaussian mechanism per epoch: mu = 2 sqrt(E d) / z exactly; PLD agrees with it
    mu = 2.0 * math.sqrt(epochs * tree_depth(spe)) / z
    g = compute_epsilon(entries, 1e-5, "gdp")
    assert g.mu == pytest.approx(mu, rel=1e-12) and g.certified
    assert g.epsilon == pytest.approx(gdp.epsilon_from_mu(1e-5, mu), rel=1e-12)
    assert compute_epsilon(entries, 1e-5, "pld").epsilon == pytest.approx(g.epsilon, rel=2e-3)
    assert compute_delta(entries, g.epsilon, "gdp").delta == pytest.approx(1e-5, rel=1e-6)
    assert compute_epsilon(entries, 1e-5, "moments").epsilon >= res.epsilon


def test_ledger_several_trees_per_epoch_take_the_deepest():
    # epochs of 9 steps, restart every 3: trees of 3, 3, 3 steps (depth 2) inside each epoch,
    # one record in one leaf of one of them: dp_accounting's step_counts=[3, 3, 3] per epoch
    aligned = _tree_ledger(900, 100, 4, 3)
    mechs = tree_acc.split_runs([(e, 1) for e in aligned], lambda n, q: 9)[1]
    assert mechs == [(pytest.approx(2.0 / (2 * math.sqrt(2))), 4)]  # one per epoch, depth 2
    curve = 4 * tree_acc.rdp_tree_aggregation(1.0, [3, 3, 3], rdp.DEFAULT_ORDERS)
    eps, _ = rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, curve, 1e-6)
    assert compute_epsilon(aligned, 1e-6).epsilon == pytest.approx(eps, rel=1e-12)
    # epochs of 8 steps, restart every 3: some trees straddle an epoch boundary (steps 7-9), so
    # every tree counts on its own (the conservative rule): more epsilon than aligned trees
    straddling = _tree_ledger(800, 100, 4, 3)
    assert compute_epsilon(straddling, 1e-6).epsilon > compute_epsilon(
        _tree_ledger(800, 100, 4, 4), 1e-6).epsilon


def test_trees_spanning_epochs_use_the_conservative_bound():
    # no restart: one tree of 3 epochs x 4 steps = 12 leaves (depth 4), record in k = 3 leaves
    entries = _tree_ledger(400, 100, 3, None, z=3.0)
    ((zeff, count),) = tree_acc.split_runs([(e, 1) for e in entries], lambda n, q: 4)[1]
    # windows each node of level l touches (leaf i in window i // 4): 1, 1, 1, 2
    caps = [max(len({i // 4 for i in range(12) if i >> l == j}) for j in range(12 >> l))
            for l in range(4)]
    s2 = min(9 * 4, 3 * sum(caps))
    assert (zeff, count) == (pytest.approx(3.0 / (2 * math.sqrt(s2))), 1)
    # a valid bound: the worst record (one leaf per window) by brute force
    exact = max(
        sum(int(np.sum(np.bincount([leaf >> l for leaf in leaves]) ** 2)) for l in range(4))
        for leaves in itertools.product(range(4), range(4, 8), range(8, 12))
    )
    assert s2 >= exact == 14
    # never better than restarting every epoch
    restarted = compute_epsilon(_tree_ledger(400, 100, 3, "epoch", z=3.0), 1e-5).epsilon
    assert compute_epsilon(entries, 1e-5).epsilon > restarted


@pytest.mark.parametrize("accountant", ["rdp", "moments", "pld", "gdp"])
def test_poisson_tree_steps_are_refused_by_every_accountant(accountant):
    entries = _tree_ledger(1000, 100, 1, "epoch", policy="poisson")
    with pytest.raises(ValueError, match="sampling policy 'poisson'.*rdp, moments, pld, gdp"):
        compute_epsilon(entries, 1e-5, accountant)


def test_mixed_samples_and_bad_events_are_refused():
    mixed = SampleEntry(SamplingEvent(100, 0.1, "shuffle"),
                        (SumQueryEvent(1.0, 1.0, "tree", tree_step=0), SumQueryEvent(1.0, 1.0)))
    with pytest.raises(ValueError, match="mixes tree-aggregation"):
        compute_epsilon([mixed], 1e-5)
    with pytest.raises(ValueError, match="tree_step must be an integer >= 0 for a tree event"):
        SumQueryEvent(1.0, 1.0, "tree")
    with pytest.raises(ValueError, match="tree_step is only allowed for mechanism='tree'"):
        SumQueryEvent(1.0, 1.0, tree_step=3)


def test_non_private_and_mixed_runs():
    entries = _tree_ledger(100, 10, 1, "epoch", z=0.0)
    assert math.isinf(compute_epsilon(entries, 1e-5).epsilon)
    gauss = [SampleEntry(SamplingEvent(1000, 0.01), (SumQueryEvent(1.0, 1.1),))] * 50
    tree_part = _tree_ledger(1000, 100, 2, "epoch")
    both = compute_epsilon(gauss + tree_part, 1e-5)
    curve = 50 * rdp.rdp_poisson_gaussian(0.01, 1.1, rdp.DEFAULT_ORDERS) + 2 * (
        tree_acc.rdp_tree_aggregation(1.0, 10, rdp.DEFAULT_ORDERS))
    assert both.epsilon == pytest.approx(
        rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, curve, 1e-5)[0], rel=1e-12)
    assert "add/remove" in both.assumptions and "tree-aggregation" in both.assumptions


def test_rdp_tree_aggregation_bad_input():
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        tree_acc.rdp_tree_aggregation(-1.0, 3, ORDERS)
    with pytest.raises(ValueError, match="steps must be an integer >= 0"):
        tree_acc.rdp_tree_aggregation(1.0, -3, ORDERS)
    with pytest.raises(ValueError, match="step_counts must be"):
        tree_acc.rdp_tree_aggregation(1.0, [], ORDERS)
    assert np.all(np.isinf(tree_acc.rdp_tree_aggregation(0.0, 3, ORDERS)))


# -- ledger file and in-graph ledger -----------------------------------------------------------

def test_tree_events_round_trip_through_the_ledger_file(tmp_path):
    entries = _tree_ledger(100, 25, 2, "epoch", seed=4)
    path = tmp_path / "tree.json"
    write_ledger_file(path, entries)
    payload = json.loads(path.read_text())
    assert payload["version"] == 1
    assert payload["runs"][1]["queries"][0]["tree_step"] == 1
    assert read_ledger_file(path) == entries
    # a file without tree events is written exactly as before (no tree_step key)
    plain = [SampleEntry(SamplingEvent(100, 0.1), (SumQueryEvent(1.0, 1.0),))]
    assert "tree_step" not in json.dumps(entries_to_payload(plain))
    # a tree event without its leaf index is refused, naming the problem
    bad = entries_to_payload(entries)
    del bad["runs"][0]["queries"][0]["tree_step"]
    bad.pop("sha256")
    import hashlib

    from tf_dp.ledger.ledger_file import _canonical
    bad["sha256"] = hashlib.sha256(_canonical(bad)).hexdigest()
    path.write_text(json.dumps(bad))
    with pytest.raises(LedgerFileError, match="tree_step must be an integer >= 0"):
        read_ledger_file(path)


def test_privacy_ledger_records_tree_steps_and_restores_them(tmp_path):
    from tf_dp.ledger.privacy_ledger import PrivacyLedger
    from tf_dp.ledger.query_with_ledger import QueryWithLedger

    ledger = PrivacyLedger()
    inner = TreeResidualSumQuery(1.0, 2.0, record_specs=tf.TensorSpec([2]), restart_every=3)
    q = QueryWithLedger(inner, ledger, population_size=30, selection_probability=1 / 3,
                        sampling_policy="shuffle")
    gs = q.initial_global_state()

    @tf.function
    def step(gs):
        return q.get_noised_result(tf.ones([2]), gs)

    for _ in range(4):
        _, gs = step(gs)
    got = ledger.samples()
    assert [e.queries[0].tree_step for e in got] == [0, 1, 2, 0]
    assert {(e.queries[0].mechanism, e.queries[0].l2_sensitivity, e.queries[0].noise_stddev)
            for e in got} == {("tree", 1.0, 2.0)}
    assert q.next_sample_entry(gs).queries[0].tree_step == 1
    ledger.save(tmp_path / "l.json")
    assert PrivacyLedger.load(tmp_path / "l.json").samples() == got
    copy = PrivacyLedger()
    copy.load_tables(*ledger.tables())
    assert copy.samples() == got
    with pytest.raises(ValueError, match="gradient_mode='jl'"):
        q.next_sample_entry(gs, jl_projections=4)


def test_cli_reads_ledgers_with_tree_events(tmp_path):
    entries = _tree_ledger(1000, 100, 3, "epoch")
    path = tmp_path / "tree.json"
    write_ledger_file(path, entries)
    p = subprocess.run([sys.executable, "-m", "tf_dp.cli.compute_dp_sgd_privacy",
                        f"--ledger={path}", "--delta=1e-5", "--accountant=all", "--format=json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for name in ("rdp", "pld", "gdp", "moments"):
        assert out[name]["epsilon"] == pytest.approx(
            compute_epsilon(entries, 1e-5, name).epsilon, rel=1e-9)
    poisson = tmp_path / "poisson.json"  # (a shorter ledger may not replace a longer one)
    write_ledger_file(poisson, _tree_ledger(1000, 100, 1, "epoch", policy="poisson"))
    p = subprocess.run([sys.executable, "-m", "tf_dp.cli.compute_dp_sgd_privacy",
                        f"--ledger={poisson}", "--delta=1e-5"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "Poisson" in p.stderr and "Traceback" not in p.stderr
