# %% [markdown]
# # Custom layers, ghost clipping and per-layer clipping
#
# DP-SGD clips every example's gradient to norm `C`. Computing every example's gradient
# separately is the slow part, and tf_dp has several ways to avoid or speed it up
# (`gradient_mode`):
#
# | mode | how the per-example norms are found |
# | --- | --- |
# | `vectorized` | per-example gradients of the whole model, by `tf.vectorized_map` |
# | `ghost` | per-layer formulas from each layer's inputs and output gradients ("ghost norms"); the per-example gradients are never formed |
# | `jl` | estimated from random projections (not exact; see the `text_classification` notebook) |
# | `auto` (default) | the fastest *exact* one for the model |
#
# This notebook shows:
#
# 1. how `gradient_mode="auto"` decides, and how to see its decision;
# 2. how to teach ghost clipping a **custom layer** by registering a norm rule, and how to
#    **test** the rule against per-example gradients computed one example at a time;
# 3. **per-layer clipping** with `NestedQuery`: a separate clip (and noise) for each variable,
#    and what the ledger and the accountant make of it.

# %% [markdown]
# ## Parameters
#
# `SMALL` (the test suite sets `TF_DP_TUTORIAL_SMALL=1`) trains on a few thousand images for one
# epoch. The checks of the rules do not depend on it.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("TF_DP_TUTORIAL_SMALL", "0") == "1"

TRAIN_SIZE = 3000 if SMALL else None  # None: the whole training set
TEST_SIZE = 1000 if SMALL else None
EPOCHS = 1 if SMALL else 5
BATCH_SIZE = 128
CHECK_BATCH = 8  # examples in the rule checks (the reference loop is slow on purpose)
L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.1
LEARNING_RATE = 0.5
DELTA = 1e-5

# %% [markdown]
# ## Data
#
# Real images only, as in the `classification_privacy` notebook: MNIST through `keras.datasets`
# (downloaded on Colab), or, without internet access, Fashion-MNIST from Debian's
# `dataset-fashion-mnist` package; `TF_DP_TUTORIAL_DATA_DIR` points at another directory of
# MNIST-format files.

# %%
import numpy as np

import tf_dp
from tf_dp.data import load_mnist_or_fashion_mnist

(x_train, y_train), (x_test, y_test), data_name = load_mnist_or_fashion_mnist(
    data_dir=os.environ.get("TF_DP_TUTORIAL_DATA_DIR")
)
x_train = (x_train[:TRAIN_SIZE].astype(np.float32) / 255.0).reshape(-1, 784)
x_test = (x_test[:TEST_SIZE].astype(np.float32) / 255.0).reshape(-1, 784)
y_train, y_test = y_train[:TRAIN_SIZE].astype(np.int32), y_test[:TEST_SIZE].astype(np.int32)
n = len(x_train)
print(f"DATA: {data_name}: {n} training and {len(x_test)} test images, flattened to 784 pixels")

# %% [markdown]
# ## 1. How `gradient_mode="auto"` chooses
#
# `tf_dp.gradients.make_clipper(gradient_mode, model)` is what the DP optimizers call on the
# first step. With `"auto"` it returns the ghost strategy when at least one layer of the model has
# a registered norm rule (`Dense`, `EinsumDense`, `Conv1D/2D`, `Embedding`, layer and group
# normalisation, attention through its projections, Keras's recurrent layers), and the
# `vectorized` strategy otherwise. Layers without a rule inside a ghost model get per-example
# gradients of *their own* variables only (mode `mixed`).
#
# Here is a custom layer, a dense layer whose `d x k` kernel is factored into two thin matrices
# `U` (`d x r`) and `V` (`r x k`) plus a bias: `y = x U V + b`. Keras knows nothing special
# about it, and neither does tf_dp yet.

# %%
import keras
import tensorflow as tf


class LowRankDense(keras.layers.Layer):
    """``y = x @ u @ v + bias``: a dense layer with a rank-``rank`` kernel."""

    def __init__(self, units, rank, **kwargs):
        super().__init__(**kwargs)
        self.units, self.rank = units, rank

    def build(self, input_shape):
        d = input_shape[-1]
        self.u = self.add_weight(shape=(d, self.rank), initializer="glorot_uniform", name="u")
        self.v = self.add_weight(shape=(self.rank, self.units), initializer="glorot_uniform",
                                 name="v")
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")

    def call(self, x):
        return tf.matmul(tf.matmul(x, self.u), self.v) + self.bias


def plain_model():
    return keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10)])


def mixed_model():
    return keras.Sequential([keras.Input((784,)), LowRankDense(64, 16),
                             keras.layers.Activation("relu"), keras.layers.Dense(10)])


def custom_only_model():
    return keras.Sequential([keras.Input((784,)), LowRankDense(10, 16)])


def describe(model):
    strategy = tf_dp.gradients.make_clipper("auto", model)
    if strategy.name == "ghost":
        plan = tf_dp.gradients.ghost.make_plan(model, model.trainable_variables)
        return f"{strategy.name} strategy, plan: {plan.description}"
    return strategy.name


choices = {}
for build in (plain_model, mixed_model, custom_only_model):
    choices[build.__name__] = describe(build())
    print(f"{build.__name__:18s} -> {choices[build.__name__]}")

# %% [markdown]
# The optimizer logs the same decision once, on the logger `tf_dp` at level INFO (Colab shows
# INFO logs of absl; here we route the logger to the cell's output):

# %%
import logging
import sys

tf_dp_logger = logging.getLogger("tf_dp")
tf_dp_logger.setLevel(logging.INFO)
if not any(getattr(h, "_notebook", False) for h in tf_dp_logger.handlers):
    handler = logging.StreamHandler(sys.stdout)
    handler._notebook = True
    tf_dp_logger.addHandler(handler)

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def private(model, **optimizer_options):
    options = dict(l2_norm_clip=L2_NORM_CLIP, noise_multiplier=NOISE_MULTIPLIER)
    options.update(optimizer_options)
    model = tf_dp.keras.make_private(model)
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(learning_rate=LEARNING_RATE, **options),
        loss=loss, metrics=["accuracy"],
    )
    return model


probe = private(mixed_model())
probe.fit(x_train[:BATCH_SIZE], y_train[:BATCH_SIZE], batch_size=BATCH_SIZE, epochs=1, verbose=0)

# %% [markdown]
# ## 2. A norm rule for the custom layer
#
# A ghost norm rule receives, for one call of the layer, its input `x` (`[B, d]`) and the
# gradient `g` of the **summed** per-example losses with respect to its output (`[B, k]`; row `b`
# belongs to example `b` alone, since examples do not interact). It returns, for every variable of
# the layer, a *factor* from which tf_dp computes each example's squared gradient norm and, later,
# the clipped sum:
#
# - `Outer(a, g)`: the per-example gradient is the outer product `a_b g_b^T` (summed over a
#   sequence axis if there is one). Its norm needs no `d x k` matrix: for one row,
#   `||a g^T||^2 = ||a||^2 ||g||^2` (Goodfellow's trick).
# - `Rows(ids, g, V)`: rows of an embedding table.
# - `PerExample(grads)`: the per-example gradients themselves (`[B, *shape]`), fine for small
#   variables such as biases.
#
# For `y = x U V + b`, with `h = x U`:
#
# - `dL/dV = h^T g`: `Outer(h, g)`;
# - `dL/dU = x^T (g V^T)`: `Outer(x, g V^T)`;
# - `dL/db = g`: `PerExample(g)`.

# %%
from tf_dp.gradients.ghost import Outer, PerExample, register_layer_norm_rule


def low_rank_dense_rule(layer, inputs, grad_output):
    x = tf.convert_to_tensor(inputs)
    h = tf.matmul(x, layer.u)
    return [
        (layer.v, Outer(h, grad_output)),
        (layer.u, Outer(x, tf.matmul(grad_output, layer.v, transpose_b=True))),
        (layer.bias, PerExample(grad_output)),
    ]


# %% [markdown]
# ### Testing the rule against per-example gradients
#
# Before trusting a rule, compare it with the definition: a `tf.GradientTape` loop that computes
# every example's gradient on its own (slow, obviously right). Two things must agree:
#
# 1. the per-example norm of every variable, which the strategy passes to the query's clipping
#    rule (a small subclass of `GaussianSumQuery` keeps them for us);
# 2. the clipped sum `sum_b min(1, C / ||g_b||) g_b` (noise switched off: `stddev=0`).
#
# `check_rule` runs the ghost strategy directly (`clipped_sum`, what the optimizer calls inside
# its training step) on a batch of `CHECK_BATCH` real images.

# %%
from tf_dp.gradients.ghost import GhostClipper


class RecordingQuery(tf_dp.GaussianSumQuery):
    """A Gaussian sum query that remembers the squared norms it was asked to clip."""

    def clip_weights(self, params, squared_norms):
        self.squared_norms = squared_norms
        return super().clip_weights(params, squared_norms)


def reference_per_example_gradients(model, x, y):
    """Every example's gradient, one example at a time."""
    grads = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            logits = model(x[i : i + 1], training=True)
            example_loss = keras.losses.sparse_categorical_crossentropy(
                y[i : i + 1], logits, from_logits=True)[0]
        grads.append([g.numpy() for g in tape.gradient(example_loss, model.trainable_variables)])
    return grads


def check_rule(model, x, y, clip=L2_NORM_CLIP):
    """Largest relative errors of the ghost norms and of the clipped sum against the loop."""
    model.compile(loss=loss)
    query = RecordingQuery(clip, 0.0)
    params = query.derive_sample_params(query.initial_global_state())
    out = GhostClipper().clipped_sum(
        tf_dp.keras.PerExampleLoss(model), (x, y, None), model.trainable_variables, query, params)
    ghost_norms = np.sqrt(np.stack([np.asarray(s) for s in query.squared_norms], 1))  # [B, vars]
    ref = reference_per_example_gradients(model, x, y)
    ref_norms = np.array([[np.linalg.norm(g) for g in per_var] for per_var in ref])
    total = np.sqrt((ref_norms**2).sum(1))
    weights = np.minimum(1.0, clip / total)
    ref_sum = [sum(w * per_var[j] for w, per_var in zip(weights, ref))
               for j in range(len(model.trainable_variables))]
    norm_error = float(np.max(np.abs(ghost_norms - ref_norms) / np.maximum(ref_norms, 1e-12)))
    sum_error = max(float(np.max(np.abs(np.asarray(a) - b)) / (np.max(np.abs(b)) + 1e-12))
                    for a, b in zip(out.clipped_sum, ref_sum))
    return norm_error, sum_error


register_layer_norm_rule(LowRankDense, low_rank_dense_rule)
keras.utils.set_random_seed(0)
x_check, y_check = x_train[:CHECK_BATCH], y_train[:CHECK_BATCH]
checked_model = mixed_model()
print("strategy now:", describe(checked_model))
rule_errors = check_rule(checked_model, x_check, y_check)
print(f"largest relative error: norms {rule_errors[0]:.2e}, clipped sum {rule_errors[1]:.2e}")

# %% [markdown]
# Both errors are at float32 rounding level: the rule is right, and the model is now handled by
# ghost clipping alone. The same check catches mistakes. A classic one: treating `grad_output`
# as the gradient of the batch *mean* loss and dividing by the batch size. The rule still runs,
# every shape fits, and the norms are wrong by a factor of `B`:

# %%
def mistaken_rule(layer, inputs, grad_output):
    batch = tf.cast(tf.shape(grad_output)[0], grad_output.dtype)
    return low_rank_dense_rule(layer, inputs, grad_output / batch)


register_layer_norm_rule(LowRankDense, mistaken_rule)  # replaces the registered rule
mistaken_errors = check_rule(checked_model, x_check, y_check)
print(f"mistaken rule: norms {mistaken_errors[0]:.2e}, clipped sum {mistaken_errors[1]:.2e}")
register_layer_norm_rule(LowRankDense, low_rank_dense_rule)  # back to the right one

# %% [markdown]
# `register_layer_norm_rule` also takes `supports(layer) -> None | reason` to refuse
# configurations the rule does not handle (those layers then fall back to per-example gradients),
# and `split_activation=True` for layers with an `activation` argument, so that `grad_output` is
# taken before the activation. `unregister_layer_norm_rule(LowRankDense)` removes it.
#
# Training with the rule registered: the optimizer's log line now says `ghost`.

# %%
import time

q = BATCH_SIZE / n
start = time.time()
custom_model = private(mixed_model())
custom_model.fit(tf_dp.data.poisson_batches(x_train, y_train, sampling_probability=q),
                 epochs=EPOCHS, verbose=2)
custom_seconds = time.time() - start
_, custom_accuracy = custom_model.evaluate(x_test, y_test, batch_size=1000, verbose=0)
custom_clipper = custom_model.optimizer.gradient_clipper
print(f"{data_name}, LowRankDense model: test accuracy {custom_accuracy:.4f} "
      f"({custom_seconds:.0f} s, clipper {custom_clipper.name})")

# %% [markdown]
# ## 3. Per-layer clipping with `NestedQuery`
#
# Flat clipping bounds the norm of the whole gradient. Per-layer clipping (McMahan et al. 2018)
# gives each variable `g` its own clip `S_g` and its own noise `sigma_g`. The gradient strategies
# hand the query one squared norm per variable, in the order of `model.trainable_variables`, so a
# `NestedQuery` with one `GaussianSumQuery` per variable does it.
#
# What is the privacy? Each group is a Gaussian mechanism on its part of the gradient; together
# they are one Gaussian mechanism with effective noise multiplier
# `z = (sum_g (S_g / sigma_g)^2)^(-1/2)` (Eq. (1) of McMahan et al.). The allocation helpers
# choose the `sigma_g` for a target `z`:
# `proportional_noise_allocation(z, clips)` sets `sigma_g = z sqrt(G) S_g`. The ledger records
# every group, and the accountant computes `z` from them.
#
# Here the total clip `C` is split evenly over the `G` variables (`S_g = C / sqrt(G)`, so a record
# whose every group is at its clip has norm exactly `C`); the biases could get smaller clips.

# %%
per_layer_model = private(plain_model())  # builds the variables; the optimizer is replaced below
variables = per_layer_model.trainable_variables
G = len(variables)
clips = [L2_NORM_CLIP / np.sqrt(G)] * G
stddevs = tf_dp.proportional_noise_allocation(NOISE_MULTIPLIER, clips)
for v, s, sd in zip(variables, clips, stddevs):
    print(f"{v.path:24s} shape {str(tuple(v.shape)):10s} clip {s:.3f}  noise stddev {float(sd):.3f}")
nested = tf_dp.NestedQuery([tf_dp.GaussianSumQuery(s, float(sd)) for s, sd in zip(clips, stddevs)])

# %% [markdown]
# First the same kind of check: per-layer clipping must scale each variable's part of each
# example's gradient by `min(1, S_g / ||g_{b,g}||)`. The ghost strategy with the nested query
# (noise off) against the loop:

# %%
def per_layer_error(model, x, y):
    model.compile(loss=loss)
    query = tf_dp.NestedQuery([tf_dp.GaussianSumQuery(s, 0.0) for s in clips])
    params = query.derive_sample_params(query.initial_global_state())
    out = GhostClipper().clipped_sum(
        tf_dp.keras.PerExampleLoss(model), (x, y, None), model.trainable_variables, query, params)
    ref = reference_per_example_gradients(model, x, y)
    errors = []
    for j, s in enumerate(clips):
        expected = sum(min(1.0, s / np.linalg.norm(per_var[j])) * per_var[j] for per_var in ref)
        got = np.asarray(out.clipped_sum[j])
        errors.append(float(np.max(np.abs(got - expected)) / (np.max(np.abs(expected)) + 1e-12)))
    return max(errors)


keras.utils.set_random_seed(0)
per_layer_check_error = per_layer_error(plain_model(), x_check, y_check)
print(f"per-layer clipping, largest relative error against the loop: {per_layer_check_error:.2e}")

# %% [markdown]
# Training with it: the query goes to the optimizer as `dp_sum_query` (instead of `l2_norm_clip`
# and `noise_multiplier`).

# %%
per_layer_model.compile(
    optimizer=tf_dp.keras.DPKerasSGDOptimizer(dp_sum_query=nested, learning_rate=LEARNING_RATE),
    loss=loss, metrics=["accuracy"],
)
per_layer_model.fit(tf_dp.data.poisson_batches(x_train, y_train, sampling_probability=q),
                    epochs=EPOCHS, verbose=2)
_, per_layer_accuracy = per_layer_model.evaluate(x_test, y_test, batch_size=1000, verbose=0)
ledger = per_layer_model.optimizer.ledger
print(ledger.samples()[0])

# %%
from tf_dp.accounting import compute_epsilon, dp_sgd_epsilon, effective_noise_multipliers

effective = effective_noise_multipliers(ledger)
per_layer_epsilon = compute_epsilon(ledger, DELTA, accountant="pld").epsilon
flat_epsilon = dp_sgd_epsilon(n, BATCH_SIZE, NOISE_MULTIPLIER, DELTA, steps=ledger.num_samples,
                              accountant="pld").epsilon
print(f"effective noise multiplier from the ledger: {min(effective):.6f} to {max(effective):.6f} "
      f"(target {NOISE_MULTIPLIER})")
print(f"per-layer clipping: epsilon = {per_layer_epsilon:.4f}; flat clipping with the same z: "
      f"{flat_epsilon:.4f}; test accuracy {per_layer_accuracy:.4f}")

# %% [markdown]
# The two epsilons agree: splitting the clip over layers with the matching noise allocation
# costs exactly as much privacy as flat clipping with noise multiplier `z`. What changes is the
# *utility*: per-layer clips stop one layer's large gradients from crowding out the others', at
# the cost of choosing more hyperparameters.
#
# ## Summary
#
# - `gradient_mode="auto"` uses ghost clipping when a layer has a norm rule and tells you what it
#   chose (`make_clipper`, the `tf_dp` log line, `optimizer.gradient_clipper`).
# - A custom layer gets ghost clipping from a few lines: a rule returning `Outer`, `Rows` or
#   `PerExample` factors for each of its variables. Test it against a per-example gradient loop
#   before using it: a wrong rule trains happily with the wrong clipping.
# - `NestedQuery` gives per-layer clips and noise; the ledger records every group and the
#   accountant combines them into one effective noise multiplier.
