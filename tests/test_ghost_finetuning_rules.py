"""Ghost norm rules for fine-tuning layers, against a per-example loop (batches of one).

LoRA-enabled ``Dense`` / ``EinsumDense`` (only the LoRA factors trainable, the kernel frozen), the
tied and untied ``ReversibleEmbedding`` (a lookup and a reverse projection of one table: the
per-example gradient is the sum of both uses, so its norm has a cross term), keras-hub's
``PositionEmbedding``, RMS normalisation (Keras's and Gemma's), with per-token targets and padding
masks as sample weights; eager, graph, XLA and mixed precision. Also the per-token loss with
per-example (Poisson padding) sample weights, and gradient-mode selection when only some
variables are trainable.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.helpers.tolerance import dense_gradient_terms, tolerance
from tests.test_ghost import RTOL, LoopReference, RecordingQuery, _compile, check, rng
from tf_dp.gradients import MicrobatchClipper, VectorizedClipper, make_clipper
from tf_dp.gradients.ghost import GhostClipper
from tf_dp.keras.losses import PerExampleLoss

L = keras.layers
V, D, T = 23, 8, 6


def lora_model(r, dtype=None):
    inp = keras.Input((5, 6))
    d1 = L.Dense(7, activation="relu", dtype=dtype)
    e1 = L.EinsumDense("abc,cde->abde", output_shape=(5, 2, 3), bias_axes="de", dtype=dtype)
    h = L.Reshape((5, 6))(e1(d1(inp)))
    d2 = L.Dense(3, dtype="float32")
    model = keras.Model(inp, d2(L.GlobalAveragePooling1D()(h)))
    for layer, rank in ((d1, 2), (e1, 3), (d2, 1)):
        layer.enable_lora(rank)
        # lora_kernel_b starts at 0, which makes lora_kernel_a's gradient 0: draw it
        layer.lora_kernel_b.assign(r.normal(size=layer.lora_kernel_b.shape).astype("float32"))
    return model


def test_lora_dense_and_einsum_dense_cover_only_the_factors():
    r = rng(0)
    model = lora_model(r)
    names = sorted(v.path.split("/")[-1] for v in model.trainable_variables)
    assert "kernel" not in names and names.count("lora_kernel_a") == 3
    x = r.normal(size=(6, 5, 6)).astype("float32")
    y = r.integers(0, 3, 6)
    sw = r.uniform(0.5, 2.0, 6).astype("float32")
    check(model, x, y, sw, reference=LoopReference)


class TiedLM(keras.Model):
    """Token ids -> (reversible) embedding + positions -> RMS norms, Dense -> tied logits."""

    def __init__(self, tie=True, cap=None, dtype=None):
        import keras_hub

        super().__init__()
        self.emb = L.ReversibleEmbedding(V, D, tie_weights=tie, logit_soft_cap=cap, dtype=dtype)
        self.pos = keras_hub.layers.PositionEmbedding(T + 2, dtype=dtype)
        self.rms = L.RMSNormalization(dtype=dtype)
        self.dense = L.Dense(D, activation="tanh", dtype=dtype)
        from keras_hub.src.models.gemma.rms_normalization import RMSNormalization

        self.gemma_rms = RMSNormalization(dtype=dtype)

    def call(self, ids):
        h = self.emb(ids)
        h = self.rms(h + self.pos(h))
        h = self.gemma_rms(self.dense(h))
        return keras.ops.cast(self.emb(h, reverse=True), "float32")


def lm_data(r, batch=6):
    ids = r.integers(1, V, (batch, T)).astype("int32")
    ids[0, :3] = ids[0, 3]  # a repeated token: several lookups of one row
    mask = np.ones((batch, T), "float32")
    mask[1, 4:] = 0.0  # padding tokens
    mask[3, 2:] = 0.0
    ids[mask == 0] = 0
    y = r.integers(0, V, (batch, T)).astype("int32")
    return ids, y, mask


def built_lm(seed, **kwargs):
    keras.utils.set_random_seed(seed)
    model = TiedLM(**kwargs)
    model(np.zeros((1, T), "int32"))
    return model


@pytest.mark.parametrize("tie, cap", [(True, None), (False, None), (True, 3.0)])
def test_reversible_and_position_embeddings_and_rms_norms(tie, cap):
    r = rng(1)
    model = built_lm(1, tie=tie, cap=cap)
    ids, y, mask = lm_data(r)
    ghost = check(model, ids, y, mask, reference=LoopReference, graph=not tie)
    assert ghost.description == "ghost"


@pytest.mark.parametrize("tie", [True, False])
def test_negative_ids_count_on_the_row_keras_reads(tie):
    """Keras's lookup (``ops.take``) reads row ``id + V`` for a negative id; the rule's rows did
    not wrap, so a table read at ``-1`` and at ``V - 1`` by one example was measured as two rows."""
    r = rng(4)
    model = built_lm(4, tie=tie)
    ids, y, mask = lm_data(r)
    ids[2, :3] = [-1, V - 1, -V]  # rows V - 1 (twice) and 0
    ids[4, 0] = -2
    ghost = check(model, ids, y, mask, reference=LoopReference)
    assert ghost.description == "ghost"
    plain = keras.Sequential([keras.Input((T,), dtype="int32"), keras.layers.Embedding(V, D),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    check(plain, ids, r.integers(0, 3, len(ids)), reference=LoopReference)


def test_tied_embedding_cross_term_matters():
    """The tied table's norm is not the norm of its two uses taken apart."""
    r = rng(2)
    model = _compile(built_lm(2))
    ids, y, mask = lm_data(r)
    data = (ids, y, mask)
    query = RecordingQuery(1e9, 0.0)
    params = query.derive_sample_params(query.initial_global_state())
    LoopReference().clipped_sum(PerExampleLoss(model), data, model.trainable_variables, query,
                                params)
    table = [i for i, v in enumerate(model.trainable_variables) if "reverse" not in v.path
             and v.path.endswith("embeddings") and "position" not in v.path][0]
    exact = np.asarray(query.squared[table])
    # the two uses as separate records: per-example gradients of the lookup and of the reverse
    # projection, from the loop with the other use's input held constant
    apart = []
    for i in range(len(ids)):
        with tf.GradientTape(persistent=True) as tape:
            h = model.emb(ids[i : i + 1])
            h2 = model.gemma_rms(model.dense(model.rms(h + model.pos(h))))
            h_const = tf.stop_gradient(h2)
            loss_lookup = keras.losses.sparse_categorical_crossentropy(
                y[i : i + 1], model.emb(h2, reverse=True), from_logits=True)
            loss_reverse = keras.losses.sparse_categorical_crossentropy(
                y[i : i + 1], model.emb(h_const, reverse=True), from_logits=True)
            loss_lookup = tf.reduce_mean(loss_lookup * mask[i : i + 1])
            loss_reverse = tf.reduce_mean(loss_reverse * mask[i : i + 1])
        total = tf.convert_to_tensor(tape.gradient(loss_lookup, model.emb.embeddings))
        rev = tf.convert_to_tensor(tape.gradient(loss_reverse, model.emb.embeddings))
        look = total - rev
        apart.append(float(tf.reduce_sum(look**2) + tf.reduce_sum(rev**2)))
        np.testing.assert_allclose(float(tf.reduce_sum(total**2)), exact[i], rtol=1e-4)
    assert np.max(np.abs(np.array(apart) - exact) / exact) > 1e-3


def _sum_fn(strategy, model, data, jit=None):
    """The unclipped sum; eager when ``jit`` is None, else a tf.function (XLA if ``jit``)."""
    loss_fn = PerExampleLoss(model)
    query = RecordingQuery(1e9, 0.0)
    params = query.derive_sample_params(query.initial_global_state())

    def fn():
        return strategy.clipped_sum(
            loss_fn, data, model.trainable_variables, query, params).clipped_sum

    return fn if jit is None else tf.function(fn, jit_compile=jit)


def test_xla():
    r = rng(3)
    model = _compile(built_lm(3))
    ids, y, mask = lm_data(r)
    data = (tf.constant(ids), tf.constant(y), tf.constant(mask))
    ref = [np.asarray(g) for g in _sum_fn(LoopReference(), model, (ids, y, mask))()]
    scale = max(np.abs(g).max() for g in ref)
    strategy = GhostClipper()
    xla = _sum_fn(strategy, model, data, True)()
    assert strategy.mode == "ghost", strategy.description  # every variable by a rule
    for got, want in zip(xla, ref):
        np.testing.assert_allclose(np.asarray(got) / scale, want / scale, rtol=0, atol=RTOL)


def test_mixed_precision():
    r = rng(3)
    model = _compile(built_lm(3))
    ids, y, mask = lm_data(r)
    data = (tf.constant(ids), tf.constant(y), tf.constant(mask))
    ref = [np.asarray(g) for g in _sum_fn(LoopReference(), model, (ids, y, mask))()]
    # float16 roundings of one example's gradient (tests/helpers/tolerance.py): forward, position
    # add 1, RMS norm D + 3, Dense D + 1 and tanh 1, Gemma RMS norm D + 3, tied logits D,
    # log-softmax V; backward the same chain without the softmax (D + 3 + 1 + D + 1 + D + 3 + 1),
    # the embedding's sum over T tokens, 2 casts; relative to the sum of the examples' |gradients|
    terms = (1 + (D + 3) + (D + 1) + 1 + (D + 3) + D + V) + (4 * D + 9 + T + 2)
    magnitude = _magnitude(model, (ids, y, mask))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        half = _compile(built_lm(3))
        lora = lora_model(rng(4))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    strategy = GhostClipper()
    out = _sum_fn(strategy, half, data, False)()
    assert strategy.mode == "ghost", strategy.description
    for got, want in zip(out, ref):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0,
                                   atol=tolerance("float16", terms, magnitude))
    # LoRA under mixed precision (float16 compute, float32 LoRA factors)
    _compile(lora)
    x = rng(5).normal(size=(5, 5, 6)).astype("float32")
    yl = rng(5).integers(0, 3, 5)
    ref = [np.asarray(g) for g in _sum_fn(LoopReference(), lora, (x, yl, None))()]
    got = _sum_fn(GhostClipper(), lora, (tf.constant(x), tf.constant(yl), None), False)()
    # float16: a dense chain 6 -> 7 (relu) -> 6 (EinsumDense) -> mean over 5 -> 3, with LoRA's
    # two factors (rank <= 3) on each layer's path (+3 each) and the mean's 5 terms
    terms = dense_gradient_terms([6, 7, 6, 3]) + 3 * 3 + 5
    atol = tolerance("float16", terms, _magnitude(lora, (x, yl, None)))
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol)


def _magnitude(model, data):
    """The largest sum over the examples of one gradient entry's absolute values (the scale of
    a sum's rounding error), from one reference run per example."""
    rows = len(data[1])
    total = None
    for i in range(rows):
        one = tuple(None if d is None else d[i:i + 1] for d in data)
        grads = [np.abs(np.asarray(g)) for g in _sum_fn(LoopReference(), model, one)()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return max(float(t.max()) for t in total)


# -- per-token targets with per-example (Poisson padding) weights ---------------------------------


def tagger(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8,), dtype="int32"), L.Embedding(30, 8, mask_zero=True), L.Dense(5)])


def tagger_data(r, n):
    x = r.integers(1, 30, (n, 8)).astype("int32")
    x[:, -2:] = 0
    return x, r.integers(0, 5, (n, 8)).astype("int32")


def test_per_token_loss_with_per_example_weights_matches_the_loop():
    """Before, the ghost strategy's batched loss failed: ``Incompatible shapes [B,8] vs [B]``."""
    r = rng(6)
    x, y = tagger_data(r, 7)
    sw = np.ones(7, "float32")
    sw[[2, 5]] = 0.0  # Poisson padding rows
    model = _compile(tagger())
    data = (x, y, sw)
    ref_q = RecordingQuery(1e9, 0.0)
    params = ref_q.derive_sample_params(ref_q.initial_global_state())
    LoopReference().clipped_sum(PerExampleLoss(model), data, model.trainable_variables, ref_q,
                                params)
    norms = np.sqrt(sum(np.asarray(s, np.float64) for s in ref_q.squared))
    assert np.all(norms[[2, 5]] == 0) and np.all(np.delete(norms, [2, 5]) > 0)
    clip = float(np.median(norms[norms > 0]))
    out = {}
    for name, strategy in (("loop", LoopReference()), ("ghost", GhostClipper())):
        q = tf_dp.GaussianSumQuery(clip, 0.0)
        p = q.derive_sample_params(q.initial_global_state())
        def run(strategy=strategy, q=q, p=p):
            o = strategy.clipped_sum(PerExampleLoss(model), data, model.trainable_variables, q, p)
            return {"norms": o.norms, "losses": o.losses, "sum": o.clipped_sum}

        out[name] = tf.function(run)() if name == "ghost" else run()
    np.testing.assert_allclose(out["ghost"]["norms"], out["loop"]["norms"], rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(out["ghost"]["losses"], out["loop"]["losses"], rtol=1e-6)
    for a, b in zip(out["ghost"]["sum"], out["loop"]["sum"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["ghost", "auto"])
def test_fit_token_tagger_on_poisson_batches(mode):
    x, y = tagger_data(rng(7), 48)
    model = tf_dp.keras.make_private(tagger())
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=0.5, learning_rate=0.5, gradient_mode=mode),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.25, seed=0), verbose=0)
    assert model.optimizer.gradient_clipper.description == "ghost"
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


# -- gradient-mode selection with frozen variables ------------------------------------------------


class Scale(L.Layer):
    """A layer without a norm rule."""

    def build(self, shape):
        self.s = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.s


def test_selection_when_only_some_variables_train():
    r = rng(8)
    x = r.normal(size=(6, 5, 6)).astype("float32")
    y = r.integers(0, 3, 6)
    # LoRA on a model with a rank-3 EinsumDense kernel (vectorized_map cannot take it)
    lora = lora_model(r)
    assert VectorizedClipper().supports(lora) is not None
    strategy = make_clipper("auto", model=lora)
    assert isinstance(strategy, GhostClipper) and strategy.mode == "ghost"
    # no refusal advises the mode that is refusing
    assert "'auto' picks ghost" in VectorizedClipper().supports(lora)
    assert "leave num_microbatches unset" in MicrobatchClipper(2).supports(lora)
    # a model whose only trainable layer has no rule: ghost runs it mixed, never refuses
    frozen = keras.Sequential([keras.Input((5, 6)), L.Dense(4), Scale(), L.Flatten(), L.Dense(3)])
    frozen.layers[0].trainable = False
    frozen.layers[-1].trainable = False
    ghost = GhostClipper()
    assert ghost.supports(frozen) is None and ghost.mode == "mixed"
    assert isinstance(make_clipper("auto", model=frozen), VectorizedClipper)
    check(frozen, x, y, reference=LoopReference, expect_mode="mixed")
    # bias-only and a frozen backbone under a new head: only trainable variables are planned
    bias_only = keras.Sequential([keras.Input((5, 6)), L.Dense(4), L.Flatten(), L.Dense(3)])
    for layer in (bias_only.layers[0], bias_only.layers[2]):
        layer.kernel.trainable = False
    assert [v.path.split("/")[-1] for v in bias_only.trainable_variables] == ["bias", "bias"]
    check(bias_only, x, y, reference=LoopReference)
