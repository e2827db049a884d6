# %% [markdown]
# # Migrating from TensorFlow Privacy to tf_dp
#
# TensorFlow Privacy (`tensorflow_privacy`) was written for Keras 2 and does not work with
# Keras 3, the Keras of current TensorFlow. tf_dp keeps its names where it can
# (`DPKerasSGDOptimizer`, `l2_norm_clip`, `noise_multiplier`, `num_microbatches`,
# `compute_dp_sgd_privacy`), so most code moves over with small edits. Some **numbers** change,
# on purpose:
#
# 1. the privacy statement is computed from a **ledger of what actually ran**, not from the
#    hyperparameters you pass to a separate function afterwards;
# 2. ordinary shuffled batches (`model.fit(x, y, batch_size=...)`) are reported with the bound that
#    does **not** assume amplification by subsampling, because shuffling is not Poisson sampling;
# 3. every statement says whether it is **certified** (a proven upper bound) or an
#    **approximation** (the Gaussian-DP central limit theorem).
#
# TensorFlow Privacy is not installed here (it would not run with Keras 3), so its code is shown
# as text; every tf_dp cell runs.

# %% [markdown]
# ## Parameters
#
# `SMALL` (the test suite sets `TF_DP_TUTORIAL_SMALL=1`) trains on 3,000 images for two epochs.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("TF_DP_TUTORIAL_SMALL", "0") == "1"

TRAIN_SIZE = 3000 if SMALL else None  # None: the whole training set
TEST_SIZE = 1000 if SMALL else None
BATCH_SIZE = 100 if SMALL else 250
EPOCHS = 2 if SMALL else 15
L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.1
LEARNING_RATE = 0.25
MICROBATCH_SIZE = 4  # for the num_microbatches discussion (accounting only)
DELTA = 1e-5

# %% [markdown]
# ## The TensorFlow Privacy version (Keras 2; shown, not run)
#
# This is the shape of TF Privacy's classic MNIST example:
#
# ```python
# import tensorflow as tf   # TF <= 2.15, tf.keras = Keras 2
# from tensorflow_privacy.privacy.optimizers.dp_optimizer_keras import DPKerasSGDOptimizer
# from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib
#
# model = tf.keras.Sequential([...])                       # an ordinary Keras 2 model
# optimizer = DPKerasSGDOptimizer(
#     l2_norm_clip=1.0,
#     noise_multiplier=1.1,
#     num_microbatches=250,                                 # must divide the batch size
#     learning_rate=0.25)
# # The loss must return one value per example (or per microbatch):
# loss = tf.keras.losses.SparseCategoricalCrossentropy(
#     from_logits=True, reduction=tf.losses.Reduction.NONE)
# model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
# model.fit(x_train, y_train, epochs=15, batch_size=250)   # shuffled fixed-size batches
#
# # Privacy, computed separately from the hyperparameters you type in again:
# eps, opt_order = compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy(
#     n=60000, batch_size=250, noise_multiplier=1.1, epochs=15, delta=1e-5)
# ```
#
# or, from the shell, `compute_dp_sgd_privacy --N=60000 --batch_size=250 --noise_multiplier=1.1
# --epochs=15 --delta=1e-5`. The number it prints uses the RDP accountant **for Poisson
# sampling**, although `model.fit` above drew shuffled batches.
#
# ## The tf_dp version
#
# | TensorFlow Privacy | tf_dp |
# | --- | --- |
# | `from tensorflow_privacy...dp_optimizer_keras import DPKerasSGDOptimizer` | `tf_dp.keras.DPKerasSGDOptimizer` (also `DPKerasAdamOptimizer`, `DPKerasAdagradOptimizer`, `make_dp_optimizer_class`) |
# | loss with `reduction=NONE` | any Keras loss; `tf_dp.keras.make_private(model)` computes per-example losses itself |
# | `num_microbatches=batch_size` (per-example clipping) | leave it out: per-example clipping is the default (`gradient_mode="auto"` picks the fastest exact method) |
# | `num_microbatches=k < batch_size` | the same argument (`gradient_mode="microbatch"`); the ledger records the sensitivity `2C` |
# | `model.fit(x, y, batch_size=B)` | the same, recorded as `shuffle`; or `tf_dp.data.poisson_batches(x, y, q)` for Poisson sampling |
# | `compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy(n, ...)` | `tf_dp.accounting.compute_epsilon(optimizer.ledger, delta)`; `dp_sgd_epsilon(n, ...)` for planning |
# | shell `compute_dp_sgd_privacy --N ...` | the same command (`--ledger run.json` to analyse what ran) |
# | `tf.keras` | `keras` (Keras 3) |

# %%
import numpy as np

import keras
import tf_dp
from tf_dp.data import load_mnist_or_fashion_mnist

(x_train, y_train), (x_test, y_test), data_name = load_mnist_or_fashion_mnist(
    data_dir=os.environ.get("TF_DP_TUTORIAL_DATA_DIR")
)
x_train = (x_train[:TRAIN_SIZE].astype(np.float32) / 255.0)[..., None]
x_test = (x_test[:TEST_SIZE].astype(np.float32) / 255.0)[..., None]
y_train, y_test = y_train[:TRAIN_SIZE].astype(np.int32), y_test[:TEST_SIZE].astype(np.int32)
n = len(x_train)
print(f"DATA: {data_name}: {n} training and {len(x_test)} test images")

# %% [markdown]
# (Data: MNIST through `keras.datasets` on Colab; without internet access, Fashion-MNIST from
# Debian's `dataset-fashion-mnist` package. Never made-up data.)
#
# The model is the CNN of TF Privacy's MNIST tutorial. The two lines that change are marked.

# %%
def build_cnn():
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])


def private_cnn():
    model = tf_dp.keras.make_private(build_cnn())  # changed: make_private
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(  # changed: tf_dp's optimizer
            l2_norm_clip=L2_NORM_CLIP, noise_multiplier=NOISE_MULTIPLIER,
            learning_rate=LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),  # no reduction=NONE
        metrics=["accuracy"],
    )
    return model


# %% [markdown]
# ### Run 1: exactly as before, `model.fit(x, y, batch_size=B)`

# %%
shuffled = private_cnn()
shuffled.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=EPOCHS, verbose=2)
_, shuffled_accuracy = shuffled.evaluate(x_test, y_test, batch_size=1000, verbose=0)
shuffled.optimizer.ledger.save("shuffled.ledger.json")
print(f"test accuracy {shuffled_accuracy:.4f}; {shuffled.optimizer.ledger.num_samples} steps")
print(shuffled.optimizer.ledger.samples()[0].sampling)

# %% [markdown]
# ### Run 2: Poisson-sampled batches, what the usual DP-SGD analysis assumes

# %%
q = BATCH_SIZE / n
poisson = private_cnn()
poisson.fit(tf_dp.data.poisson_batches(x_train, y_train, sampling_probability=q),
            epochs=EPOCHS, verbose=2)
_, poisson_accuracy = poisson.evaluate(x_test, y_test, batch_size=1000, verbose=0)
poisson.optimizer.ledger.save("poisson.ledger.json")
print(f"test accuracy {poisson_accuracy:.4f}; {poisson.optimizer.ledger.num_samples} steps")
print(poisson.optimizer.ledger.samples()[0].sampling)

# %% [markdown]
# ## What changes in the numbers
#
# ### 1. The same command, from hyperparameters
#
# `compute_dp_sgd_privacy` keeps TF Privacy's flags. Given only hyperparameters it assumes Poisson
# sampling (as TF Privacy's function did) and says so in its statement. `run` calls it and returns
# its JSON output (`--format=json`); in a notebook `!compute_dp_sgd_privacy ...` works as well.

# %%
import json
import shutil
import subprocess
import sys


def run(*args):
    """Runs tf_dp's compute_dp_sgd_privacy with ``args``; returns its output."""
    tool = shutil.which("compute_dp_sgd_privacy")
    cmd = [tool] if tool else [sys.executable, "-m", "tf_dp.cli.compute_dp_sgd_privacy"]
    out = subprocess.run(cmd + list(args), capture_output=True, text=True, check=True)
    return out.stdout


hyper = [f"--N={n}", f"--batch_size={BATCH_SIZE}", f"--noise_multiplier={NOISE_MULTIPLIER}",
         f"--epochs={EPOCHS}", f"--delta={DELTA}"]
print(run(*hyper, "--accountant=rdp"))
cli_poisson = json.loads(run(*hyper, "--accountant=all", "--format=json"))

# %% [markdown]
# ### 2. The ledger of what ran
#
# `--ledger` reads the record the optimizer kept: the sampling of every step (`n`, `q`, `poisson`
# or `shuffle`), the clip and the noise as they were at that step (schedules, a changed batch
# size, a resumed run are all in it). Run 2's ledger gives the Poisson number above:

# %%
print(run("--ledger=poisson.ledger.json", f"--delta={DELTA}", "--accountant=rdp"))
ledger_poisson = json.loads(run("--ledger=poisson.ledger.json", f"--delta={DELTA}",
                                "--accountant=all", "--format=json"))

# %% [markdown]
# ### 3. Shuffled batches: no amplification assumed
#
# Run 1 drew shuffled fixed-size batches, as TF Privacy's example did. Amplification by
# subsampling is proven for Poisson sampling (and for sampling without replacement of a *random*
# batch at every step), not for one shuffle per epoch that uses each example exactly once. TF
# Privacy reported the Poisson number anyway. tf_dp reports the bound that holds for shuffling:
# with the dataset size fixed (replace-one adjacency, sensitivity `2C`), each epoch is at worst one
# Gaussian mechanism with noise multiplier `sigma / 2` on the whole dataset, and `E` epochs
# compose to `mu`-GDP with `mu = 2 sqrt(E) / sigma`, exactly.

# %%
print(run("--ledger=shuffled.ledger.json", f"--delta={DELTA}", "--accountant=pld"))
ledger_shuffled = json.loads(run("--ledger=shuffled.ledger.json", f"--delta={DELTA}",
                                 "--accountant=all", "--format=json"))

# %%
print(f"{'':34s}{'rdp':>9s}{'pld':>9s}{'gdp':>9s}")
rows = {
    "hyperparameters (Poisson assumed)": cli_poisson,
    "run 2 ledger (Poisson, as ran)": ledger_poisson,
    "run 1 ledger (shuffle, as ran)": ledger_shuffled,
}
for label, out in rows.items():
    print(f"{label:34s}" + "".join(f"{out[k]['epsilon']:9.3f}" for k in ("rdp", "pld", "gdp")))
print(f"test accuracy: shuffled {shuffled_accuracy:.4f}, Poisson {poisson_accuracy:.4f}")

# %% [markdown]
# The two runs train about equally well (the noise is unseeded, so accuracies differ by a few
# points from run to run); only Poisson sampling earns the small epsilon. To keep the
# small epsilon, feed `tf_dp.data.poisson_batches` to `fit`: it is a one-line change.
#
# ### 4. Certified or approximate
#
# Every result carries `certified`. `rdp`, `moments` and `pld` are proven upper bounds. `gdp`
# (Bu et al. 2019's central limit theorem) is an approximation for Poisson-subsampled runs and can
# be *below* the true epsilon; it is printed as such. (For a shuffled run the GDP composition is
# exact, and there it is certified.)

# %%
for label, out in rows.items():
    print(f"{label:34s} gdp certified: {out['gdp']['certified']}; "
          f"pld certified: {out['pld']['certified']}")
print()
print(run(*hyper, "--accountant=gdp"))

# %% [markdown]
# ### 5. Microbatches
#
# With `num_microbatches=k` smaller than the batch, TF Privacy clipped the *mean* gradient of each
# microbatch to `C` and accounted as if each clipped vector were one example's. Under add/remove
# adjacency, adding one example changes one microbatch's mean by up to `2C` (the mean it joins
# changes completely), so tf_dp records sensitivity `2C`: the effective noise multiplier is halved.
# The optimizer takes the same `num_microbatches`; the command line takes the microbatch size:

# %%
print(run(*hyper, "--accountant=rdp", f"--microbatch_size={MICROBATCH_SIZE}"))
cli_microbatch = json.loads(run(*hyper, "--accountant=rdp", f"--microbatch_size={MICROBATCH_SIZE}",
                                "--format=json"))

# %% [markdown]
# ### 6. Custom training loops
#
# TF Privacy users who wrote their own `GradientTape` loop called the optimizer's gradient
# method with a vector of per-example losses (shown, not run):
#
# ```python
# with tf.GradientTape() as tape:
#     loss = loss_fn(y, model(x))                   # reduction=NONE: one loss per example
# grads_and_vars = optimizer._compute_gradients(loss, model.trainable_variables, tape=tape)
# optimizer.apply_gradients(grads_and_vars)
# ```
#
# In tf_dp the same loop calls `tf_dp.keras.DPTrainStep`: the DP step that `fit` runs (clip per
# example, noise, record in the optimizer's ledger, divide, apply). Declare how your loop draws its
# batches (`sampling=`), mark each new pass over the data, and flush the ledger after every call
# of a compiled function. XLA (`jit_compile=True`), mixed precision and `MirroredStrategy` work
# as in `fit`.

# %%
import tensorflow as tf

loop_model = build_cnn()
loop_optimizer = tf_dp.keras.DPKerasSGDOptimizer(
    l2_norm_clip=L2_NORM_CLIP, noise_multiplier=NOISE_MULTIPLIER, learning_rate=LEARNING_RATE)
dp_step = tf_dp.keras.DPTrainStep(
    loop_model, loop_optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    sampling=tf_dp.engine.Sampling(n, BATCH_SIZE / n, policy="shuffle"))


@tf.function
def train_step(x, y):
    return dp_step(x, y)  # the batch's mean loss; the update is applied


batches = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(n, seed=0)
dp_step.start_pass()  # one pass over the data (one epoch)
for x_batch, y_batch in batches.batch(BATCH_SIZE, drop_remainder=True):
    loss = train_step(x_batch, y_batch)
    dp_step.flush()
print(f"custom loop: {loop_optimizer.ledger.num_samples} steps recorded, last loss "
      f"{float(loss):.3f}")
print(tf_dp.accounting.compute_epsilon(loop_optimizer.ledger, delta=DELTA))

# %% [markdown]
# ## Summary
#
# - Code: `tf_dp.keras.make_private(model)`, `tf_dp.keras.DPKerasSGDOptimizer(...)`, any Keras 3
#   loss; `num_microbatches` only if you want microbatches; `tf_dp.keras.DPTrainStep` in a
#   custom loop.
# - Numbers: compute them from `optimizer.ledger` (`compute_epsilon`, or `compute_dp_sgd_privacy
#   --ledger`). Shuffled batches get the unamplified bound; use `poisson_batches` for the
#   amplified one. `gdp` is labelled an approximation; report `pld` or `rdp`.
