"""DP-AdaFEST through the Keras surface: ``DPKeras*Optimizer(..., sparse_embeddings=
SparseEmbeddingConfig(...))`` with ``model.fit``.

Checked against independent computations: a per-example ``GradientTape`` loop over the whole model
(joint clipping of the table and the rest), hand-built row sets for the selection, and
``dp_accounting`` for the epsilon of the saved ledger.
"""

from __future__ import annotations

import json

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.accounting import compute_epsilon
from tf_dp.dp_query.partition_selection import SparseEmbeddingConfig
from tf_dp.ledger import read_ledger_file

EPS32 = float(np.finfo(np.float32).eps)
V, D, L = 30, 4, 3


def _embedding_model(seed=0, rows=V):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((L,), dtype="int32")
    h = keras.layers.Embedding(rows, D, name="emb")(inp)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inp, keras.layers.Dense(1, name="out")(h))


def _token_position_model(seed=0):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(seed)
    inp = keras.Input((L,), dtype="int32")
    layer = keras_hub.layers.TokenAndPositionEmbedding(V, L, D, name="tpe")
    h = keras.layers.GlobalAveragePooling1D()(layer(inp))
    return keras.Model(inp, keras.layers.Dense(1, name="out")(h))


def _data(seed, n):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 12, (n, L)).astype(np.int32)  # rows 12.. never touched
    x[0] = [2, 2, 5]  # a repeated id
    return x, rng.normal(size=(n, 1)).astype(np.float32)


def _reference_sum(model, x, y, clip):
    """Sum over examples of the per-example gradient clipped jointly (all variables) to
    ``clip``: a GradientTape per example, dense table gradients."""
    variables = model.trainable_variables
    total = [np.zeros(v.shape, np.float64) for v in variables]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            pred = model(x[i : i + 1])
            loss = tf.reduce_mean(tf.square(pred - y[i : i + 1]))
        grads = [tf.convert_to_tensor(g).numpy().astype(np.float64)
                 for g in tape.gradient(loss, variables)]
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        w = min(1.0, clip / norm)
        for t, g in zip(total, grads):
            t += w * g
    return total


def _table(model):
    for layer in model._flatten_layers():
        if isinstance(layer, keras.layers.Embedding):
            return layer.embeddings
    raise AssertionError("no embedding")


@pytest.mark.parametrize("build", [_embedding_model, _token_position_model],
                         ids=["Embedding", "keras_hub.TokenAndPositionEmbedding"])
def test_no_noise_zero_threshold_is_the_clipped_per_example_sum(build):
    """Noise 0, threshold 0: one SGD step (lr 1) moves the table by minus the jointly clipped
    per-example sum over B on the touched rows and leaves every other row exactly as it was;
    the rest of the model (Dense; the position table) moves as in the same reference."""
    n, clip = 16, 0.05  # the clip binds for every example
    x, y = _data(0, n)
    model = build()
    ref = _reference_sum(model, x, y, clip)
    before = [v.numpy().copy() for v in model.trainable_variables]
    private = tf_dp.keras.make_private(model)
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=1.0, sparse_embeddings=
        SparseEmbeddingConfig(threshold=0.0, selection_noise_multiplier=0.0))
    private.compile(optimizer=opt, loss="mse")
    private.fit(x, y, batch_size=n, epochs=1, shuffle=False, verbose=0)
    table = _table(model)
    touched = np.unique(x)
    for v, b, r in zip(model.trainable_variables, before, ref):
        got = b - v.numpy()
        want = r / n
        # float32 sums of n examples' rows (L lookups each) and the update's subtraction
        tol = 4 * (n * L + 2) * EPS32 * (np.abs(b).max() + np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=v.path)
        if v is table:
            untouched = np.setdiff1d(np.arange(V), touched)
            assert np.array_equal(v.numpy()[untouched], b[untouched])  # bit for bit
            assert np.all(np.abs(want[touched]).sum(1) > 0)


def _adam_run(threshold, noise_multiplier, selection_noise=0.0, optimizer="Adam"):
    x = np.array([[3, 3, 3]] * 4 + [[5, 5, 5]] + [[7, 7, 7]] * 2, np.int32)  # counts 4, 1, 2
    y = np.ones((len(x), 1), np.float32)
    model = tf_dp.keras.make_private(_embedding_model(1))
    table = _table(model)
    before = table.numpy().copy()
    cls = getattr(tf_dp.keras, f"DPKeras{optimizer}Optimizer")
    opt = cls(l2_norm_clip=1.0, noise_multiplier=noise_multiplier, learning_rate=0.1,
              sparse_embeddings=SparseEmbeddingConfig(threshold, selection_noise))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    slots = [s for s in opt.variables if tuple(s.shape) == (V, D)]
    return before, table.numpy(), slots, opt, model


def test_slots_move_only_on_selected_rows_and_survive_a_keras_file(tmp_path, optimizer="Adam"):
    """Rows 3, 5, 7 are touched by 4, 1 and 2 examples (one distinct row each, contribution
    weight 1), threshold 1.5 without selection noise selects {3, 7}: with gradient noise on,
    the table and the optimizer's slots change on rows 3 and 7 only; row 5 (touched, not
    selected) gets nothing, not noise. Saved as .keras and reloaded, the model keeps the sparse
    configuration and the ledger, and trains on sparsely."""
    before, after, slots, opt, model = _adam_run(1.5, 1.0, optimizer=optimizer)
    assert slots, "no [V, D] slot found"
    moved = np.nonzero(np.any(after != before, axis=1))[0]
    assert moved.tolist() == [3, 7]
    for s in slots:
        init = 0.1 if optimizer == "Adagrad" else 0.0  # Adagrad's initial accumulator value
        changed = np.nonzero(np.any(np.abs(s.numpy() - init) > 0, axis=1))[0]
        assert changed.tolist() == [3, 7], s.path
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.engine.privacy.sparse_embeddings == opt.engine.privacy.sparse_embeddings
    assert loaded.optimizer.ledger.num_samples == 1
    table = _table(loaded)
    x = np.array([[3, 3, 3], [5, 5, 5], [3, 3, 3]], np.int32)
    before = table.numpy().copy()
    loaded.fit(x, np.ones((3, 1), np.float32), batch_size=3, epochs=1, verbose=0)
    assert loaded.optimizer.ledger.num_samples == 2
    moved = np.nonzero(np.any(table.numpy() != before, axis=1))[0]
    # counts 2 and 1: only row 3 is selected; row 7 moves by Adam's momentum from step 1, row 5
    # (touched, not selected) still not at all, nor its slots
    assert moved.tolist() == [3, 7]
    slots = [s for s in loaded.optimizer.variables if tuple(s.shape) == (V, D)]
    assert len(slots) == 2 and all(not np.any(s.numpy()[5]) for s in slots)


def test_selection_noise_selects_at_the_gaussian_rate():
    """Threshold 2 sigma1-units above the empty rows' count 0: in one step the rows nobody
    touched (of 20000) are selected at P(N(0,1) > 2) (binomial 5-sigma band), and only the
    selected ones move (noise only); the touched rows (count 32 / sqrt(3), 10 sigma1 above the
    threshold) are all selected. Seeded noise (a fixed draw)."""
    rows, sigma1 = 20_000, 1.5
    x = np.tile(np.array([[0, 1, 2]], np.int32), (32, 1))  # rows 0..2, weight 1/sqrt(3) each
    y = np.zeros((32, 1), np.float32)
    model = tf_dp.keras.make_private(_embedding_model(2, rows))
    table = _table(model)
    before = table.numpy().copy()
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1.0, noise_seed=7,
        sparse_embeddings=SparseEmbeddingConfig(threshold=2.0 * sigma1,
                                                selection_noise_multiplier=sigma1))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    moved = np.any(table.numpy() != before, axis=1)
    assert moved[:3].all()
    hits, trials = int(moved[3:].sum()), rows - 3
    p = 0.022750131948179195  # P(N(0, 1) > 2)
    assert abs(hits - trials * p) <= 5 * np.sqrt(trials * p * (1 - p))


def test_ledger_records_both_queries_and_reloaded_file_composes_them(tmp_path):
    """Poisson batches: every step records the gradient query (C, z C) and the selection
    (C1, sigma1 C1); epsilon from the saved and re-read ledger file equals dp_accounting's
    Poisson-subsampled composition of the two Gaussians; the threshold is in the metadata."""
    n, q, z, sigma1, c1, clip = 64, 0.125, 1.3, 2.0, 2.0, 0.5
    x, y = _data(3, n)
    model = tf_dp.keras.make_private(_embedding_model(3))
    cfg = SparseEmbeddingConfig(threshold=4.0, selection_noise_multiplier=sigma1,
                                contribution_bound=c1)
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=clip, noise_multiplier=z,
                                          learning_rate=0.1, sparse_embeddings=cfg)
    model.compile(optimizer=opt, loss="mse")
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=q, steps_per_epoch=3,
                                         seed=0)
    model.fit(batches, epochs=1, verbose=0)
    path = tmp_path / "ledger.json"
    opt.ledger.save(path)
    entries = read_ledger_file(path)
    assert len(entries) == 3
    for e in entries:
        assert e.sampling.policy == "poisson"
        assert e.sampling.population_size == n
        assert e.sampling.selection_probability == pytest.approx(q, rel=1e-12)
        got = sorted((ev.l2_sensitivity, ev.noise_stddev) for ev in e.queries)
        want = sorted([(clip, z * clip), (c1, sigma1 * c1)])
        np.testing.assert_allclose(got, want, rtol=1e-6)
    meta = json.loads(path.read_text())["metadata"]["sparse_embeddings"]
    assert meta == cfg.get_config()
    delta = 1e-5
    for accountant, rtol in (("rdp", 1e-6), ("pld", 2e-2)):
        ours = compute_epsilon(str(path), delta, accountant).epsilon
        # two Gaussians of the same Poisson sample: one Gaussian of the combined multiplier
        # (dp_accounting's PoissonSampledDpEvent takes a single Gaussian)
        combined = (z**-2 + sigma1**-2) ** -0.5
        event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(combined)), 3)
        oracle = (dp_accounting.rdp.RdpAccountant() if accountant == "rdp"
                  else dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4))
        assert ours == pytest.approx(oracle.compose(event).get_epsilon(delta), rel=rtol)


def test_xla_is_refused_naming_the_option():
    x, y = _data(5, 8)
    model = tf_dp.keras.make_private(_embedding_model(5))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.0, sparse_embeddings=SparseEmbeddingConfig(5.0, 3.0)),
        loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.optimizer.ledger.num_samples == 0


def test_distribution_strategy_is_refused():
    x, y = _data(6, 8)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = tf_dp.keras.make_private(_embedding_model(6))
        model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0,
            sparse_embeddings=SparseEmbeddingConfig(5.0, 3.0)), loss="mse")
    with pytest.raises(ValueError, match="tf.distribute"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_bad_arguments_are_refused_naming_them():
    for kwargs, match in (
        ({"threshold": -1.0, "selection_noise_multiplier": 1.0}, "threshold must be"),
        ({"threshold": 1.0, "selection_noise_multiplier": float("nan")},
         "selection_noise_multiplier must be"),
        ({"threshold": 1.0, "selection_noise_multiplier": 1.0, "contribution_bound": 0.0},
         "contribution_bound must be"),
        ({"threshold": 1.0, "selection_noise_multiplier": 1.0, "layers": []}, "layers must be"),
    ):
        with pytest.raises(ValueError, match=match):
            SparseEmbeddingConfig(**kwargs)
    cfg = SparseEmbeddingConfig(5.0, 3.0)
    with pytest.raises(ValueError, match="gradient_mode"):
        tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                        gradient_mode="vectorized", sparse_embeddings=cfg)
    with pytest.raises(ValueError, match="num_microbatches"):
        tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                        num_microbatches=2, sparse_embeddings=cfg)
    with pytest.raises(TypeError, match="SparseEmbeddingConfig"):
        tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                        sparse_embeddings={"threshold": 1.0})
    x, y = _data(7, 8)
    model = tf_dp.keras.make_private(_embedding_model(7))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.0,
        sparse_embeddings=SparseEmbeddingConfig(5.0, 3.0, layers=["nope"])), loss="mse")
    with pytest.raises(ValueError, match="nope"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.optimizer.ledger.num_samples == 0


def test_for_target_epsilon_calibrates_both_queries():
    """The calibrated gradient multiplier sigma2 with the selection's sigma1 meets the target:
    the epsilon of both queries (tf_dp's adafest_epsilon and dp_accounting at the combined
    multiplier) is at most the target and within 1% of it; a sigma1 too small is refused."""
    from tf_dp.accounting.partition_selection import adafest_epsilon

    n, batch, epochs, target, delta, sigma1 = 10_000, 100, 2, 2.0, 1e-5, 4.0
    opt = tf_dp.keras.DPKerasSGDOptimizer.for_target_epsilon(
        target, delta, n=n, batch_size=batch, epochs=epochs, l2_norm_clip=1.0,
        sparse_embeddings=SparseEmbeddingConfig(5.0, sigma1))
    sigma2, steps = opt.noise_multiplier, epochs * n // batch
    eps = adafest_epsilon(n, batch / n, steps, sigma2, sigma1, delta, "rdp").epsilon
    combined = (sigma2**-2 + sigma1**-2) ** -0.5
    oracle = dp_accounting.rdp.RdpAccountant().compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(batch / n, dp_accounting.GaussianDpEvent(combined)),
        steps)).get_epsilon(delta)
    assert eps <= target * (1 + 1e-9) and eps >= 0.99 * target
    assert oracle == pytest.approx(eps, rel=1e-6)
    with pytest.raises(ValueError, match="selection_noise_multiplier"):
        tf_dp.keras.DPKerasSGDOptimizer.for_target_epsilon(
            target, delta, n=n, batch_size=batch, epochs=epochs, l2_norm_clip=1.0,
            sparse_embeddings=SparseEmbeddingConfig(5.0, 0.5))


# -- DP-FEST: fixed rows ---------------------------------------------------------------------

FIXED = [2, 5, 7, 20]  # 2, 5, 7 touched by the data (ids 0..11), 20 never


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fixed_rows_release_the_clipped_sum_on_those_rows_only(jit_compile):
    """DP-FEST (rows fixed once, e.g. from public frequencies): noise 0, one SGD step (lr 1)
    moves the fixed rows that the batch touched by minus the jointly clipped per-example sum over
    B (the reference's rows), and no other row: touched rows outside the set stay bit for bit;
    the Dense layer moves as in the reference. Fixed shapes: the step also runs under XLA."""
    n, clip = 16, 0.05
    x, y = _data(0, n)
    model = _embedding_model()
    ref = _reference_sum(model, x, y, clip)
    before = [v.numpy().copy() for v in model.trainable_variables]
    private = tf_dp.keras.make_private(model)
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=1.0,
        sparse_embeddings=SparseEmbeddingConfig(rows={"emb": FIXED}))
    private.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    private.fit(x, y, batch_size=n, epochs=1, shuffle=False, verbose=0)
    table = _table(model)
    for v, b, r in zip(model.trainable_variables, before, ref):
        got = b - v.numpy()
        want = r / n
        if v is table:
            others = np.setdiff1d(np.arange(V), FIXED)
            assert np.array_equal(v.numpy()[others], b[others])  # bit for bit
            assert np.all(np.abs(want[np.setdiff1d(np.unique(x), FIXED)]).sum(1) > 0)
            got, want = got[FIXED], want[FIXED]
        tol = 4 * (n * L + 2) * EPS32 * (np.abs(b).max() + np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=v.path)
    assert opt.ledger.num_samples == 1


def test_fixed_rows_ledger_holds_the_gradient_query_alone(tmp_path):
    """With noise on, every fixed row moves (row 20, untouched, by noise) and no other row; the
    ledger records one sum query per step (no selection), and epsilon from the saved file
    equals dp_accounting's Poisson-subsampled Gaussian of the gradient's multiplier."""
    n, q, z, clip = 64, 0.125, 1.3, 0.5
    x, y = _data(3, n)
    model = tf_dp.keras.make_private(_embedding_model(3))
    table = _table(model)
    before = table.numpy().copy()
    cfg = SparseEmbeddingConfig(rows=FIXED)  # the model's only sparse table
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=clip, noise_multiplier=z,
                                          learning_rate=0.1, sparse_embeddings=cfg)
    model.compile(optimizer=opt, loss="mse")
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=q, steps_per_epoch=3,
                                         seed=0), epochs=1, verbose=0)
    moved = np.nonzero(np.any(table.numpy() != before, axis=1))[0]
    assert moved.tolist() == FIXED
    path = tmp_path / "ledger.json"
    opt.ledger.save(path)
    entries = read_ledger_file(path)
    assert len(entries) == 3
    for e in entries:
        np.testing.assert_allclose([(ev.l2_sensitivity, ev.noise_stddev) for ev in e.queries],
                                   [(clip, z * clip)], rtol=1e-6)
    delta = 1e-5
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 3)
    oracle = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)
    assert compute_epsilon(str(path), delta, "rdp").epsilon == pytest.approx(oracle, rel=1e-6)
    # for_target_epsilon with fixed rows calibrates the gradient's Gaussian alone
    cal = tf_dp.keras.DPKerasSGDOptimizer.for_target_epsilon(
        2.0, 1e-5, n=1000, batch_size=50, epochs=2, l2_norm_clip=1.0, sparse_embeddings=cfg)
    plain = tf_dp.keras.DPKerasSGDOptimizer.for_target_epsilon(
        2.0, 1e-5, n=1000, batch_size=50, epochs=2, l2_norm_clip=1.0)
    assert cal.noise_multiplier == pytest.approx(plain.noise_multiplier, rel=1e-12)
    # saved in the optimizer's config and back
    again = SparseEmbeddingConfig.from_config(json.loads(json.dumps(cfg.get_config())))
    assert again == cfg


def test_fixed_rows_are_checked_naming_the_problem():
    for kwargs, match in (
        ({"rows": [1, 2], "threshold": 1.0}, "threshold must be None with rows="),
        ({"rows": []}, "non-empty 1-d"),
        ({"rows": [1, -2]}, ">= 0"),
        ({"rows": {"emb": [0.5]}}, "integer row ids"),
        ({}, "threshold is required"),
    ):
        with pytest.raises(ValueError, match=match):
            SparseEmbeddingConfig(**kwargs)
    x, y = _data(7, 8)
    for rows, match in (({"other": [1]}, "no entry for the sparse table of layer 'emb'"),
                        ({"emb": [1, V]}, f"row id {V} is out of range")):
        model = tf_dp.keras.make_private(_embedding_model(7))
        model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0,
            sparse_embeddings=SparseEmbeddingConfig(rows=rows)), loss="mse")
        with pytest.raises(ValueError, match=match):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert model.optimizer.ledger.num_samples == 0


def test_private_histogram_rows_are_recorded_and_composed_with_training():
    """DP-FEST from a privately counted histogram: ``private_row_counts`` adds N(0, (sigma C1)^2)
    to the clipped contribution map of the whole data set (noise mean and spread within 5
    standard errors over 20000 empty rows, seeded) and records one Gaussian over all examples in
    a ledger; that ledger's runs with the training's (on the top rows) give dp_accounting's
    composition of that Gaussian with the Poisson-subsampled steps."""
    from tf_dp.dp_query.partition_selection import private_row_counts, top_rows

    big = np.zeros((40, L), np.int64)
    noisy = private_row_counts(big, 20_000, 2.0, 1.5, seed=3).numpy()[1:]  # rows nobody touched
    sd = 1.5 * 2.0
    assert abs(noisy.mean()) < 5 * sd / np.sqrt(noisy.size)
    assert abs(noisy.std() / sd - 1) < 5 / np.sqrt(2 * noisy.size)

    n, q, z, sigma, clip = 64, 0.125, 1.3, 4.0, 0.5
    x, y = _data(8, n)
    model = tf_dp.keras.make_private(_embedding_model(8))
    histogram = tf_dp.ledger.PrivacyLedger()
    rows = top_rows(private_row_counts(x, V, 1.0, sigma, ledger=histogram), 8).numpy()
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=clip, noise_multiplier=z, learning_rate=0.1,
        sparse_embeddings=SparseEmbeddingConfig(rows=rows))
    model.compile(optimizer=opt, loss="mse")
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=q, steps_per_epoch=3,
                                         seed=0), epochs=1, verbose=0)
    assert histogram.num_samples == 1 and opt.ledger.num_samples == 3
    entry = histogram.samples()[0]
    assert entry.sampling.population_size == n and entry.sampling.selection_probability == 1.0
    delta = 1e-5
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.GaussianDpEvent(sigma),
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 3)])
    oracle = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)
    both = histogram.runs() + opt.ledger.runs()
    assert compute_epsilon(both, delta, "rdp").epsilon == pytest.approx(oracle, rel=1e-6)
