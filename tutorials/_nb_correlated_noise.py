# %% [markdown]
# # Correlated noise: DP-SGD vs banded matrix factorization (BandMF)
#
# DP-SGD adds fresh Gaussian noise at every step. DP matrix factorization adds at step `t` the
# row `t` of `C^{-1} Z` instead, with `Z` i.i.d. Gaussian and `C` a lower-triangular *strategy*:
# later noise cancels part of earlier noise in the sums of gradients that the model's parameters
# are. This notebook trains the same model with both at the same epsilon and shows how to save and
# resume a run without breaking the mechanism.
#
# The privacy of both runs is computed here from first principles: with fixed batches in a fixed
# order, every record takes part once every `b` steps; the run is a Gaussian mechanism `C x + Z`
# whose sensitivity is the largest norm of the sum of `C`'s columns at one record's steps.

# %% [markdown]
# ## Parameters
#
# `SMALL` (the test suite sets `TF_DP_TUTORIAL_SMALL=1`) trains on 3,000 images for a few epochs.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("TF_DP_TUTORIAL_SMALL", "0") == "1"

TRAIN_SIZE = 3000 if SMALL else None  # None: the whole training set
TEST_SIZE = 1000 if SMALL else None
PARTS = 6  # b: batches per epoch; every record once every b steps
EPOCHS = 3 if SMALL else 20
BANDS = PARTS  # BandMF's band (b-min-separation: participations never share a band)
TARGET_EPSILON = 3.0
DELTA = 1e-5
L2_NORM_CLIP = 1.0
LEARNING_RATE = 0.5
MOMENTUM = 0.9

# %% [markdown]
# ## Data and model
#
# Fashion-MNIST (MNIST on Colab), shuffled once: the `b` batches of an epoch are the same records
# in the same order every epoch.

# %%
import keras
import numpy as np
from scipy import optimize, special, stats

import tf_dp
from tf_dp.data import load_mnist_or_fashion_mnist

(x_train, y_train), (x_test, y_test), data_name = load_mnist_or_fashion_mnist(
    data_dir=os.environ.get("TF_DP_TUTORIAL_DATA_DIR")
)
x_train = x_train[:TRAIN_SIZE].reshape(-1, 784).astype(np.float32) / 255.0
x_test = x_test[:TEST_SIZE].reshape(-1, 784).astype(np.float32) / 255.0
y_train, y_test = y_train[:TRAIN_SIZE].astype(np.int32), y_test[:TEST_SIZE].astype(np.int32)
batch = len(x_train) // PARTS
order = np.random.default_rng(0).permutation(batch * PARTS)
x_train, y_train = x_train[order], y_train[order]
steps = PARTS * EPOCHS
print(f"DATA: {data_name}: {len(x_train)} images, {PARTS} batches of {batch}, {steps} steps")


def make_model():
    return tf_dp.keras.DPSequential(
        [keras.Input((784,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )


# %% [markdown]
# ## The strategy: a banded square root of the prefix sums
#
# `C` with `C[t, t-j] = binom(2j, j) / 4^j` for `j < BANDS` (0 beyond) is the square root of
# the prefix-sum matrix, cut to `BANDS` bands. `DPKerasMFOptimizer` takes its noise recurrence:
# `coef[t, j] = C[t, t - j]`.

# %%
j = np.arange(BANDS)
r = np.exp(special.gammaln(2 * j + 1) - 2 * special.gammaln(j + 1) - j * np.log(4))
C = sum(np.diag(np.full(steps - k, r[k]), -k) for k in range(min(BANDS, steps)))
coef = np.array([[C[t, t - k] if t - k >= 0 else 0.0 for k in range(BANDS)] for t in range(steps)])


class BandedSqrt:  # a noise recurrence: what a strategy's noise_recurrence() returns
    pass


strategy = BandedSqrt()
strategy.coef = coef
print("first band coefficients:", np.round(r[:4], 4))

# %% [markdown]
# ## Equal epsilon
#
# A record of batch `p` takes part at steps `p, p + b, ...`; add or remove it and `C x` moves by
# `clip * C u_p`. The sensitivity is the largest `||C u_p||` (DP-SGD: `C = I`, `sqrt(epochs)`).
# Both runs are Gaussian mechanisms; the noise multiplier of each is set so that
# `mu = sensitivity / sigma` gives `TARGET_EPSILON` at `DELTA` (the Gaussian mechanism's exact
# `(epsilon, delta)` curve, Balle & Wang 2018).

# %%
def gaussian_delta(eps, mu):
    return stats.norm.cdf(-eps / mu + mu / 2) - np.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)


def sensitivity(c):
    return max(np.linalg.norm(c[:, p::PARTS].sum(axis=1)) for p in range(PARTS))


mu = optimize.brentq(lambda m: gaussian_delta(TARGET_EPSILON, m) - DELTA, 1e-6, 100.0) * (1 - 1e-9)
sens = {"DP-SGD": sensitivity(np.eye(steps)), "BandMF": sensitivity(C)}
sigmas = {name: s / mu for name, s in sens.items()}
for name in sens:
    print(f"{name}: sensitivity {sens[name]:.3f}, noise multiplier {sigmas[name]:.3f}")

# %% [markdown]
# ## Train both

# %%
def train(name, epochs=EPOCHS, model=None):
    keras.utils.set_random_seed(1)
    common = dict(l2_norm_clip=L2_NORM_CLIP, learning_rate=LEARNING_RATE, momentum=MOMENTUM)
    if name == "DP-SGD":
        opt = tf_dp.keras.DPKerasSGDOptimizer(noise_multiplier=sigmas[name], **common)
    else:
        opt = tf_dp.keras.DPKerasMFOptimizer(
            noise_multiplier=sigmas[name], strategy=strategy, **common
        )
    model = make_model()
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x_train, y_train, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model


accuracy = {}
for name in ("DP-SGD", "BandMF"):
    model = train(name)
    accuracy[name] = model.evaluate(x_test, y_test, verbose=0)[1]
    print(f"{name}: test accuracy {accuracy[name]:.4f} at epsilon {TARGET_EPSILON}")

# %% [markdown]
# ## Saving and resuming
#
# The noise state (step counter and the `BANDS - 1` past noises) is saved with the optimizer, so
# a run resumed from a checkpoint continues the same mechanism: here one epoch, a save, a new
# model loading it, and the optimizer's step counter picking up where it was.

# %%
first = train("BandMF", epochs=1)
first.save_weights("bandmf.weights.h5")
resumed = make_model()
resumed.compile(
    optimizer=tf_dp.keras.DPKerasMFOptimizer(
        l2_norm_clip=L2_NORM_CLIP, noise_multiplier=sigmas["BandMF"], strategy=strategy,
        learning_rate=LEARNING_RATE, momentum=MOMENTUM,
    ),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
resumed.load_weights("bandmf.weights.h5")
resumed_step = resumed.optimizer.mf_step
print(f"resumed at noise step {resumed_step} of {steps}")
