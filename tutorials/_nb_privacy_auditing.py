# %% [markdown]
# # Privacy auditing: a measured lower bound beside the certified epsilon
#
# The epsilon that tf_dp prints is an **upper bound**, proven from the ledger of what ran. An
# **audit** measures the other side: it plants *canaries* (records each included in training with
# probability 1/2, the coin recorded), trains, and tests how well an attacker tells the included
# canaries from the others. Any success rate above chance implies a **lower bound** on epsilon,
# at a stated confidence.
#
# - A lower bound **above** the certificate proves the code, or its accounting, wrong.
# - A lower bound well **below** it is not evidence of privacy: this attack, with this many
#   canaries, could not show more.
#
# You will:
#
# - audit a correct DP-SGD run with white-box gradient canaries (the attacker reads every
#   iterate) and compare the audited lower bound with the certified epsilon;
# - audit a broken run (noise switched off) and see the audit catch it;
# - run the classic **membership-inference** attack (loss threshold) against a non-private and a
#   private model of the same architecture: AUC and true positive rate at low false positive
#   rates.

# %% [markdown]
# ## Parameters
#
# `SMALL` runs a quick version (fewer canaries and examples; well under a minute): the test suite
# uses it, with `TF_DP_TUTORIAL_SMALL=1`. Leave it off for the real run.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("TF_DP_TUTORIAL_SMALL", "0") == "1"

CANARIES = 1000 if SMALL else 5000  # canaries per training
TRAININGS = 1 if SMALL else 4  # independent trainings; their canaries are pooled
BROKEN_CANARIES = 2000 if SMALL else 5000  # canaries of the broken run (one training)
AUDIT_STEPS = 10  # DP steps per audited training
MI_SIZE = 1000 if SMALL else 5000  # members (training examples) = non-members (held out)
MI_EPOCHS = 30 if SMALL else 60  # epochs of the membership-inference models
DELTA = 1e-5

# %% [markdown]
# ## Data
#
# Real data only: `tf_dp.data.load_mnist_or_fashion_mnist` tries MNIST through `keras.datasets`
# (a download) and otherwise reads Fashion-MNIST from Debian's `dataset-fashion-mnist` package;
# `TF_DP_TUTORIAL_DATA_DIR` points it at another directory of MNIST-format IDX files. Images are
# flattened to 784 features for a small dense model.

# %%
import numpy as np

from tf_dp.data import load_mnist_or_fashion_mnist

(x_train, y_train), (x_test, y_test), data_name = load_mnist_or_fashion_mnist(
    data_dir=os.environ.get("TF_DP_TUTORIAL_DATA_DIR")
)
x_train = x_train.reshape(len(x_train), -1).astype(np.float32) / 255.0
x_test = x_test.reshape(len(x_test), -1).astype(np.float32) / 255.0
y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)
print(f"{data_name}: {len(x_train)} training and {len(x_test)} test images")

# %% [markdown]
# ## 1. A white-box audit of a correct DP-SGD run
#
# `tf_dp.auditing.audit_dp_sgd` builds a fresh model and DP optimizer, adds **Dirac gradient
# canaries** and trains with the ordinary `model.fit` on Poisson batches: canaries go through
# the same clipping, noise and ledger as real data. Canary `j`'s gradient is a large vector on
# its own extra weight `w[j]`, which real data never touches; clipping brings it to the clip `C`.
# The attacker sees every iterate: it reads `w[j]` after each step, and scores each canary by the
# likelihood ratio of "trained on" vs "not" for the configured mechanism (for full-batch DP-SGD,
# the sum of the updates).
#
# The report puts the certified epsilon (from the training's ledger) beside three measured
# figures: the **one-run** bound (Steinke, Nasr & Jagielski 2023; assumes nothing), the
# **many-run** Clopper-Pearson bound (canaries as independent trials) and the **GDP** bound
# (assumes the mechanism is Gaussian-DP, which full-batch DP-SGD exactly is).

# %%
import keras

import tf_dp.keras
from tf_dp.accounting import compute_epsilon
from tf_dp.auditing import audit_dp_sgd
from tf_dp.data import poisson_batches

NOISE = 6.8  # noise multiplier of the correct run: certified epsilon about 2 after 10 steps
audit_x, audit_y = x_train[:256], y_train[:256]


def small_model():
    return keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])


def sgd(noise_multiplier):
    return lambda: tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=noise_multiplier, learning_rate=0.1,
        gradient_mode="vectorized")


correct = audit_dp_sgd(
    model_fn=small_model, optimizer_fn=sgd(NOISE), x=audit_x, y=audit_y,
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    sampling_probability=1.0, steps=AUDIT_STEPS, num_canaries=CANARIES, trainings=TRAININGS,
    delta=DELTA, seed=0)
print(correct)

# %% [markdown]
# The scores of included and excluded canaries are two overlapping bell curves: the more they
# overlap, the smaller the epsilon an attacker can prove. (Full batch: each included canary adds
# exactly one clip per step; the noise has standard deviation `sigma` clips per step.)

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3))
bins = np.linspace(correct.scores.min(), correct.scores.max(), 60)
ax.hist(correct.scores[correct.included], bins, alpha=0.6, label="canary included")
ax.hist(correct.scores[~correct.included], bins, alpha=0.6, label="canary left out")
ax.set_xlabel("score (sum of the updates, in clips)")
ax.legend()
plt.show()

# %% [markdown]
# ## 2. A broken run is caught
#
# The same audit of a run whose noise was (by mistake) switched off. Its certificate says
# epsilon is infinite, so the report is compared with the epsilon the correct configuration
# certifies: the audited lower bound is far above it, which no correct run can produce.

# %%
broken = audit_dp_sgd(
    model_fn=small_model, optimizer_fn=sgd(0.0), x=audit_x, y=audit_y,
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    sampling_probability=1.0, steps=AUDIT_STEPS, num_canaries=BROKEN_CANARIES, trainings=1,
    delta=DELTA, seed=1)
print(broken)
print(f"\nbroken run's audited lower bound {broken.lower_bound:.2f} vs the correct configuration's "
      f"certificate {correct.certified.epsilon:.2f}")

# %% [markdown]
# ### A defect the ledger hides: `threat_model="white_box_gradient"`
#
# Above, the broken run's own ledger says "no noise" (epsilon infinite). A worse bug adds less
# noise (or clips at a larger norm, or samples at a higher rate) than its ledger records: the
# certificate looks fine. `audit_dp_sgd(..., threat_model="white_box_gradient")` is built to catch
# that: the same gradient canaries through the real DP step, every one a record (an excluded
# canary has a zero gradient), scored by the likelihood ratio of its per-step updates, and tested
# against the certificate's whole privacy profile (its epsilon at 24 deltas, at thresholds fixed
# in advance). Its report states its power, the smallest violation it detects with probability
# 0.9 at this budget (`report.power`), and what it cannot see (`report.sees()`). In the
# configuration of docs/auditing.md ("An audit with power": noise multiplier 2, q = 0.5, 10
# steps, 4000 canaries, a few seconds) it flags no noise, noise / 10, no clipping, a clip 10x the
# recorded and a sampling rate 2x the recorded, each planted below the optimizer while the ledger
# records the configured run (tests/test_audit_power.py), and not the correct run.

# %% [markdown]
# ## 3. Membership inference on real models
#
# The classic view (Yeom et al. 2018; Carlini et al. 2022 for reporting at low false positive
# rates): train a model on `MI_SIZE` images (the *members*), hold out as many (*non-members*), and
# guess "member" when the model's loss on an image is low. `tf_dp.auditing.loss_attack` reports
# the ROC AUC and the true positive rate at false positive rates of 0.1% and 1%. The same
# two-layer network is trained without privacy and with DP-SGD (Poisson batches, clip 1).
#
# These numbers describe one attack on one model: they are not bounds, and an AUC near 0.5 does
# not prove privacy (the audit above is what relates an attack to epsilon).

# %%
from tf_dp.auditing import loss_attack

members = (x_train[:MI_SIZE], y_train[:MI_SIZE])
non_members = (x_test[:MI_SIZE], y_test[:MI_SIZE])
mi_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((784,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(10)])


non_private = mlp()
non_private.compile(optimizer=keras.optimizers.Adam(1e-3), loss=mi_loss, metrics=["accuracy"])
non_private.fit(*members, batch_size=64, epochs=MI_EPOCHS, verbose=0)

BATCH = 100
private = tf_dp.keras.make_private(mlp())
private.compile(
    optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.5, gradient_mode="vectorized"),
    loss=mi_loss, metrics=["accuracy"])
private.fit(poisson_batches(*members, sampling_probability=BATCH / MI_SIZE),
            epochs=MI_EPOCHS, verbose=0)
private_epsilon = compute_epsilon(private.optimizer.ledger, DELTA, "pld")

mi = {}
for name, model in (("non-private", non_private), ("private", private)):
    result = loss_attack(model, members, non_members, loss=mi_loss, fprs=(0.001, 0.01))
    test_accuracy = model.evaluate(x_test[MI_SIZE:], y_test[MI_SIZE:], verbose=0)[1]
    mi[name] = result
    print(f"{name:12s} test accuracy {test_accuracy:.1%}  {result}")
print(f"\nthe private model's certificate: {private_epsilon}")

# %% [markdown]
# The non-private model remembers its training images (their loss is much lower than the held-out
# images'), and the attack finds many members at a low false positive rate. DP-SGD bounds what any
# attack can achieve: an `(epsilon, delta)`-DP training allows at most `TPR <= e^epsilon FPR +
# delta` at every threshold, here for the certified epsilon of the private run.

# %%
for fpr in (0.001, 0.01):
    ceiling = min(1.0, np.exp(private_epsilon.epsilon) * fpr + DELTA)
    print(f"FPR {fpr:.1%}: non-private TPR {mi['non-private'].tpr_at_fpr[fpr]:.1%}, private TPR "
          f"{mi['private'].tpr_at_fpr[fpr]:.1%} (DP allows at most {ceiling:.1%})")

# %% [markdown]
# ## What the numbers mean
#
# - The audited lower bound of the correct run is below its certificate, as it must be; how close
#   it comes depends on the number of canaries and trainings (docs/auditing.md has a table).
# - The broken run's lower bound is far above what the configuration was meant to certify: an
#   audit catches a mechanism that does not do what its ledger says.
# - Membership inference on a real model measures the leakage of one practical attack; the
#   certificate bounds every attack.
