# %% [markdown]
# # Private image classification with tf_dp
#
# This notebook trains a Keras image classifier with **differentially private SGD** (DP-SGD,
# Abadi et al. 2016) and reads off the privacy guarantee of the run. DP-SGD changes two things
# in ordinary training:
#
# 1. every example's gradient is **clipped** to an L2 norm of at most `C`, so no single example
#    can move the model by much;
# 2. Gaussian **noise** of standard deviation `sigma * C` is added to the sum of the clipped
#    gradients before the optimizer takes its step.
#
# Combined with random sampling of the batches, this gives an `(epsilon, delta)` guarantee:
# whether any one training example was in the data or not changes the probability of anything
# the trained model does by a factor of at most `e^epsilon` (plus a small `delta`).
#
# You will:
#
# - make an ordinary Keras model private in two lines;
# - feed it **Poisson-sampled** batches, the sampling the privacy analysis assumes;
# - watch epsilon grow epoch by epoch (`PrivacyReport`) and stop before a budget is spent
#   (`PrivacyBudget`);
# - save the run's **ledger** (the record of what actually ran), load it back and analyse it with
#   every accountant tf_dp has;
# - see what privacy costs in accuracy, for a few noise levels.

# %% [markdown]
# ## Parameters
#
# `SMALL` runs a quick version (a few thousand examples, a couple of epochs; about half a minute
# on a laptop CPU): the test suite uses it, with `TF_DP_TUTORIAL_SMALL=1`. Leave it off for the
# real run; with it off, everything below uses the whole data set.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("TF_DP_TUTORIAL_SMALL", "0") == "1"

TRAIN_SIZE = 2000 if SMALL else None  # None: the whole training set
TEST_SIZE = 1000 if SMALL else None
BATCH_SIZE = 100 if SMALL else 256  # expected batch size under Poisson sampling
MAX_EPOCHS = 4 if SMALL else 20  # we ask for this many epochs ...
TARGET_EPSILON = 2.1 if SMALL else 1.0  # ... but stop when this budget is spent
SWEEP_EPOCHS = 2 if SMALL else 5  # epochs per run in the noise sweep
DELTA = 1e-5

# %% [markdown]
# ## Data
#
# The notebook uses real data only. `tf_dp.data.load_mnist_or_fashion_mnist` first tries MNIST
# through `keras.datasets` (on Colab this downloads it); on a machine without internet access it
# reads Fashion-MNIST from the IDX files of Debian's `dataset-fashion-mnist` package
# (`/usr/share/datasets/fashion-mnist`). It never makes up data: with neither available it stops
# with an error saying how to get some. `TF_DP_TUTORIAL_DATA_DIR` points it at another directory of
# MNIST-format IDX files instead.

# %%
import numpy as np

from tf_dp.data import load_mnist_or_fashion_mnist

(x_train, y_train), (x_test, y_test), data_name = load_mnist_or_fashion_mnist(
    data_dir=os.environ.get("TF_DP_TUTORIAL_DATA_DIR")
)
x_train, y_train = x_train[:TRAIN_SIZE], y_train[:TRAIN_SIZE]
x_test, y_test = x_test[:TEST_SIZE], y_test[:TEST_SIZE]

# Pixels in [0, 1], one channel; integer labels.
x_train = (x_train.astype(np.float32) / 255.0)[..., None]
x_test = (x_test.astype(np.float32) / 255.0)[..., None]
y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)
n = len(x_train)
print(f"{data_name}: {n} training and {len(x_test)} test images of shape {x_train.shape[1:]}")

# %%
import matplotlib.pyplot as plt

FASHION_CLASSES = ["T-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt",
                   "sneaker", "bag", "boot"]
fig, axes = plt.subplots(1, 8, figsize=(10, 1.6))
for ax, image, label in zip(axes, x_train, y_train):
    ax.imshow(image[..., 0], cmap="gray")
    ax.set_title(FASHION_CLASSES[label] if data_name == "fashion_mnist" else int(label))
    ax.axis("off")
plt.show()

# %% [markdown]
# ## An ordinary Keras model
#
# The convolutional network of Bu et al. 2019 (*Deep learning with Gaussian differential
# privacy*): two convolutions, two max-poolings and two dense layers, about 26,000 weights. Nothing
# in it is specific to privacy. Batch normalization is the one common layer DP-SGD cannot use (it
# mixes the examples of a batch, so one example's gradient would depend on the others); use
# `GroupNormalization` or `LayerNormalization` instead.

# %%
import keras


def build_cnn():
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2, 1),
            keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
            keras.layers.MaxPooling2D(2, 1),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


build_cnn().summary()

# %% [markdown]
# ## Making it private: two lines
#
# - `tf_dp.keras.make_private(model)` lets the model compute **per-example** losses and gradients
#   in its training step (Keras itself only ever sees the batch average).
# - `tf_dp.keras.DPKerasSGDOptimizer` holds the privacy settings, clips and noises the gradients,
#   and records every step in its **ledger**:
#   - `l2_norm_clip` is `C`. Gradients with a norm above it are scaled down to it.
#   - `noise_multiplier` is `sigma`: the noise on the summed gradient has standard deviation
#     `sigma * C`. More noise, more privacy per step, slower learning.
#   - `learning_rate` as usual. The noisy update is averaged over the *expected* batch size, a
#     public number, and DP-SGD likes larger learning rates than ordinary SGD.
#
# The values are those of the first row of Bu et al. 2019, Table 1 (`C = 1.5`, `sigma = 1.3`,
# batch 256), with a learning rate of 0.5 that learns faster in short runs.
#
# How the per-example gradients are computed is the optimizer's `gradient_mode`. The default,
# `"auto"`, picks the fastest exact method for the model: here **ghost clipping**, which gets every
# example's gradient norm from the layers' inputs and output gradients without materialising the
# per-example gradients (the `custom_layers_and_ghost_clipping` notebook explains it).

# %%
import tf_dp

L2_NORM_CLIP = 1.5
NOISE_MULTIPLIER = 1.3
LEARNING_RATE = 0.5
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

model = tf_dp.keras.make_private(build_cnn())  # 1
model.compile(
    optimizer=tf_dp.keras.DPKerasSGDOptimizer(  # 2
        l2_norm_clip=L2_NORM_CLIP, noise_multiplier=NOISE_MULTIPLIER, learning_rate=LEARNING_RATE
    ),
    loss=loss,
    metrics=["accuracy"],
)

# %% [markdown]
# ## Poisson-sampled batches
#
# The privacy analysis of DP-SGD gets most of its strength from **amplification by subsampling**:
# each step only sees a random fraction of the data, so any one example is usually not even in
# the batch. The standard analysis assumes **Poisson sampling**: at every step, every example is
# included independently with probability `q = batch_size / n`. Batch sizes then vary from step to
# step (around `q * n`).
#
# `tf_dp.data.poisson_batches` draws such batches. To keep one compiled training step, batches are
# padded to a fixed size with rows of weight zero, which the DP step ignores. An "epoch" is
# `round(1 / q)` steps. The model's `fit` reads the sampling (`n`, `q`, `poisson`) from it and the
# ledger records it with every step.
#
# (Plain `model.fit(x, y, batch_size=...)` also works: its shuffled fixed-size batches are
# recorded as `shuffle`, and the accountants then give the much larger bound that does not assume
# amplification. The `privacy_accounting` notebook shows the difference.)

# %%
q = BATCH_SIZE / n
batches = tf_dp.data.poisson_batches(x_train, y_train, sampling_probability=q)
print(f"q = {BATCH_SIZE}/{n} = {q:.5f}")
print(f"{batches.steps_per_epoch} steps per epoch, batches padded to {batches.max_batch_size} rows")

# %% [markdown]
# ## Before training: what will it cost?
#
# The privacy cost depends only on `q`, `sigma`, the number of steps and `delta`, never on the
# data, so it can be computed before training. `delta` should be well below `1/n`; `1e-5` is
# the usual choice for 60,000 examples.

# %%
from tf_dp.accounting import dp_sgd_epsilon

for epochs in (1, MAX_EPOCHS // 2, MAX_EPOCHS):
    planned = dp_sgd_epsilon(n, BATCH_SIZE, NOISE_MULTIPLIER, DELTA, epochs=epochs)
    print(f"{epochs:3d} epochs: epsilon = {planned.epsilon:.3f} at delta = {DELTA:g}")

# %% [markdown]
# ## Training with a privacy report and a budget
#
# Two callbacks:
#
# - `PrivacyReport(delta)` adds the epsilon spent so far to each epoch's logs, computed from the
#   optimizer's ledger, so it ends up in `history.history["epsilon"]` next to the accuracy.
# - `PrivacyBudget(target_epsilon, delta)` stops training *before* the step that would take
#   epsilon above the target (the stopping rule of Abadi et al.'s algorithm). We ask for
#   `MAX_EPOCHS` epochs; the budget ends training earlier.
#
# `validation_data` evaluates the model on the test set after every epoch. Evaluating costs no
# privacy of the *training* data (only the training data are protected here).

# %%
import time

report = tf_dp.keras.PrivacyReport(delta=DELTA)
budget = tf_dp.keras.PrivacyBudget(target_epsilon=TARGET_EPSILON, delta=DELTA)
start = time.time()
history = model.fit(
    batches,
    epochs=MAX_EPOCHS,
    validation_data=(x_test, y_test),
    callbacks=[report, budget],
    verbose=2,
)
train_seconds = time.time() - start
print(f"gradient mode chosen by 'auto': {model.optimizer.gradient_clipper.description}")
print(f"{model.optimizer.ledger.num_samples} DP steps in {train_seconds:.0f} s")

# %%
_, test_accuracy = model.evaluate(x_test, y_test, batch_size=1000, verbose=0)
print(f"test accuracy: {test_accuracy:.4f}")
print(f"budget stopped training: {budget.stopped}; epsilon spent: {budget.epsilon_spent:.3f}")

# %% [markdown]
# Test accuracy and epsilon, epoch by epoch. Epsilon grows quickly at first and then more slowly:
# privacy losses of independent steps add up in a way that grows roughly like the square root of
# the number of steps, not linearly. The last epoch may be shorter than the others when the budget
# stopped it.

# %%
from matplotlib.ticker import FormatStrFormatter, MaxNLocator, NullFormatter

epochs_run = np.arange(1, len(history.history["epsilon"]) + 1)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.plot(epochs_run, history.history["val_accuracy"], "o-")
ax1.set_xlabel("epoch")
ax1.set_ylabel("test accuracy")
ax1.set_title(f"{data_name}, DP-SGD (sigma = {NOISE_MULTIPLIER})")
ax2.plot(epochs_run, history.history["epsilon"], "o-", color="C1")
ax2.axhline(TARGET_EPSILON, color="gray", linestyle="--", label="budget")
ax2.set_xlabel("epoch")
ax2.set_ylabel(f"epsilon (delta = {DELTA:g})")
ax2.legend()
for ax in (ax1, ax2):
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
plt.tight_layout()
plt.show()

# %% [markdown]
# ## The ledger: what actually ran
#
# The optimizer recorded, for every step, how the batch was sampled (`n`, `q`, policy) and what
# the query did (L2 sensitivity `C`, noise standard deviation `sigma * C`). That record, not the
# hyperparameters you meant to use, is what the privacy statement is computed from. Save it next
# to the model: it is a small JSON file (identical steps are run-length encoded) with a checksum.

# %%
import json

LEDGER_PATH = "classification_privacy.ledger.json"
model.optimizer.ledger.save(
    LEDGER_PATH, metadata={"notebook": "classification_privacy", "data": data_name}
)
with open(LEDGER_PATH) as f:
    print(json.dumps(json.load(f)["runs"], indent=1))

# %% [markdown]
# Load it back, as you would months later, and analyse it with each accountant:
#
# | accountant | what it is | a guarantee? |
# | --- | --- | --- |
# | `rdp` | Rényi DP of the subsampled Gaussian, with the tight conversion to `(epsilon, delta)` | yes |
# | `moments` | the same Rényi curve with the original moments-accountant conversion of Abadi et al. | yes, looser |
# | `pld` | privacy loss distributions composed numerically, rounded pessimistically | yes, the tightest |
# | `gdp` | Gaussian DP through the privacy central limit theorem (Bu et al. 2019) | **no**: an approximation |
#
# They all analyse the same mechanism; they differ in how much slack their mathematics leaves.
# `pld` is the number to report; `gdp` is labelled an approximation wherever it is shown and can
# be *below* the true value.

# %%
from tf_dp.accounting import compute_epsilon

reloaded = tf_dp.PrivacyLedger.load(LEDGER_PATH)
print(f"reloaded ledger: {reloaded.num_samples} steps")
results = {
    name: compute_epsilon(reloaded, delta=DELTA, accountant=name)
    for name in ("rdp", "moments", "pld", "gdp")
}
print(f"{'accountant':<10} {'epsilon':>8}  certified")
for name, result in results.items():
    print(f"{name:<10} {result.epsilon:8.3f}  {result.certified}")
final_epsilon = results["pld"].epsilon

# %% [markdown]
# `PrivacyReport` and `PrivacyBudget` used `rdp`, their default (fast enough to run after every
# step). The `pld` accountant certifies a smaller epsilon for the very same run: pass
# `accountant="pld"` to both callbacks to train longer within the same budget.
#
# Each result also explains itself in words, assumptions included:

# %%
print(results["pld"])
print()
print(results["gdp"])

# %% [markdown]
# The same analysis from a shell, on the saved file:
#
# ```
# compute_dp_sgd_privacy --ledger classification_privacy.ledger.json --delta 1e-5 --accountant all
# ```

# %% [markdown]
# ## What privacy costs in accuracy
#
# The noise multiplier trades privacy for accuracy. We train a fresh private model for
# `SWEEP_EPOCHS` epochs at a few noise levels and, for reference, the same network without privacy
# (plain Keras with Adam on shuffled batches). Each private run's epsilon comes from its own
# ledger.

# %%
sweep = []
for sigma in (0.6, 1.0, 2.0, 4.0):
    private_model = tf_dp.keras.make_private(build_cnn())
    private_model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=L2_NORM_CLIP, noise_multiplier=sigma, learning_rate=LEARNING_RATE
        ),
        loss=loss,
        metrics=["accuracy"],
    )
    private_model.fit(
        tf_dp.data.poisson_batches(x_train, y_train, sampling_probability=q),
        epochs=SWEEP_EPOCHS,
        verbose=0,
    )
    _, accuracy = private_model.evaluate(x_test, y_test, batch_size=1000, verbose=0)
    epsilon = compute_epsilon(private_model.optimizer.ledger, DELTA, accountant="pld").epsilon
    sweep.append((sigma, epsilon, accuracy))
    print(f"sigma = {sigma:3.1f}: epsilon = {epsilon:7.3f}, test accuracy = {accuracy:.4f}")

baseline = build_cnn()
baseline.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
baseline.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=SWEEP_EPOCHS, verbose=0)
_, baseline_accuracy = baseline.evaluate(x_test, y_test, batch_size=1000, verbose=0)
print(f"non-private: test accuracy = {baseline_accuracy:.4f}")

# %%
sigmas, epsilons, accuracies = zip(*sweep)
fig, ax = plt.subplots(figsize=(6, 4))
ax.plot(epsilons, accuracies, "o-", label="DP-SGD")
for sigma, epsilon, accuracy in sweep:
    ax.annotate(f"sigma={sigma:g}", (epsilon, accuracy), textcoords="offset points", xytext=(5, -12))
ax.axhline(baseline_accuracy, color="gray", linestyle="--", label="non-private")
ax.set_xscale("log")
ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
ax.xaxis.set_minor_formatter(NullFormatter())
ax.set_xticks([0.1, 0.3, 1, 3, 10, 30])
ax.set_xlim(min(epsilons) / 1.5, max(epsilons) * 1.5)
ax.set_xlabel(f"epsilon (delta = {DELTA:g}, PLD accountant)")
ax.set_ylabel("test accuracy")
ax.set_title(f"{data_name}, {SWEEP_EPOCHS} epochs")
ax.legend()
plt.show()

# %% [markdown]
# Smaller epsilon (more noise) costs accuracy; the gap to the non-private model shrinks as epsilon
# grows. Longer training, a tuned learning rate and clip, and more data all move the curve up: the
# noise is added to a *sum* over the batch, so its relative size falls as batches grow.
#
# ## Next
#
# - `privacy_accounting.ipynb`: what the accountants compute, why they differ, tradeoff curves,
#   shuffled vs Poisson batches, and choosing the noise for a target budget.
# - `migrating_from_tf_privacy.ipynb`: the same training written with TensorFlow Privacy, side by
#   side with tf_dp.
