# %% [markdown]
# # Sparse DP for embedding tables (DP-AdaFEST)
#
# DP-SGD adds Gaussian noise to every coordinate it releases. For an embedding table of a
# million rows that means a million noisy rows per step, although a batch touches a few
# thousand: the update stops being sparse and the noise lands on rows the data never touched.
# DP-AdaFEST (Ghazi et al. 2023) releases noise only on rows chosen by a private partition
# selection: each step counts the rows the batch touched (each example's contribution bounded),
# adds Gaussian noise to the counts and keeps the rows above a threshold. Only those rows get the
# noised gradient, as a `tf.IndexedSlices`.
#
# In tf_dp this is one optimizer argument, `sparse_embeddings=SparseEmbeddingConfig(...)`; the
# rest of the model keeps the usual per-example clipping, jointly with the table. This notebook
# trains a small recommendation model three ways (non-private, DP with dense table noise, DP
# with sparse noise at the same certified epsilon), shows that the sparse update touches only
# selected rows, and reads both queries of each step from the saved ledger.

# %% [markdown]
# ## Parameters
#
# `SMALL` (the test suite sets `TF_DP_TUTORIAL_SMALL=1`) trains on fewer examples for fewer
# steps.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("TF_DP_TUTORIAL_SMALL", "0") == "1"

N = 4_000 if SMALL else 50_000  # training examples (users)
ITEMS = 2_000 if SMALL else 20_000  # rows of the embedding table
LENGTH = 10  # items in a user's history
BATCH = 200 if SMALL else 500  # expected batch size (Poisson sampling)
STEPS = 30 if SMALL else 300
NOISE_MULTIPLIER = 1.0  # the dense run's z; the sparse run splits it (below)
SELECTION_NOISE_MULTIPLIER = 3.0  # sigma1
THRESHOLD = 10.0
DP_LEARNING_RATE = 20.0
LEARNING_RATE = 10.0  # non-private (unclipped) run
DELTA = 1e-5
ACCOUNTANT = "rdp" if SMALL else "pld"  # PLD is tighter; RDP is faster (both certified)

# %% [markdown]
# ## Data: power-law item histories
#
# Each item belongs to one of two genres. A user prefers one genre; each item of their history
# comes from that genre with probability 0.7, and within a genre items are drawn by popularity
# (Zipf, exponent 1.1: a few items are very popular, most are rare). The label is the user's
# preferred genre. The best possible accuracy is the majority vote of the history's genres.

# %%
import numpy as np


def make_data(n, seed=0):
    rng = np.random.default_rng(seed)
    genre_of = rng.integers(0, 2, ITEMS)
    by_genre = [rng.permutation(np.flatnonzero(genre_of == k)) for k in (0, 1)]
    g = rng.integers(0, 2, n)
    same = rng.random((n, LENGTH)) < 0.7
    which = np.where(same, g[:, None], 1 - g[:, None])
    rank = rng.zipf(1.1, size=(n, LENGTH)) - 1
    ids = np.empty((n, LENGTH), np.int32)
    for k in (0, 1):
        m = which == k
        ids[m] = by_genre[k][np.minimum(rank[m], len(by_genre[k]) - 1)]
    return ids, g.astype(np.float32)[:, None], same


x, y, same = make_data(N + 5_000)
x_train, y_train, x_test, y_test = x[:N], y[:N], x[N:], y[N:]
votes = same[N:].sum(1)
bayes = float(np.mean(np.where(votes * 2 == LENGTH, 0.5, votes * 2 > LENGTH)))
touched = np.bincount(x_train.ravel(), minlength=ITEMS)
print(f"{N} users, {ITEMS} items; {np.mean(touched == 0):.0%} of the items never appear; "
      f"the 1% most popular items make {np.sort(touched)[::-1][: ITEMS // 100].sum() / touched.sum():.0%} "
      f"of the lookups; best possible accuracy {bayes:.3f}")

# %% [markdown]
# ## Three runs
#
# The model is `Embedding(ITEMS, 8) -> mean -> Dense(1)`. Both DP runs clip every example's
# gradient (table rows and Dense layer together) to norm 1 and sample Poisson batches. The dense
# run adds `N(0, z^2)` to every coordinate. The sparse run has two noisy queries per step: the
# row counts (noise multiplier `sigma1`) and the gradient on the selected rows (`sigma2`). With
# `sigma1^-2 + sigma2^-2 = z^-2`, the two Gaussians of a step cost exactly what one Gaussian
# with multiplier `z` costs, so both runs certify the same epsilon.

# %%
import keras

import tf_dp
from tf_dp.accounting import compute_epsilon

SIGMA2 = (NOISE_MULTIPLIER**-2 - SELECTION_NOISE_MULTIPLIER**-2) ** -0.5
q = BATCH / N
loss = keras.losses.BinaryCrossentropy(from_logits=True)


def make_model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(ITEMS, 8, name="items")(inp)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inp, keras.layers.Dense(1)(h))


def accuracy(model):
    logits = model.predict(x_test, batch_size=4096, verbose=0).ravel()
    return float(np.mean((logits > 0) == (y_test.ravel() > 0.5)))


baseline = make_model()
baseline.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=loss)
baseline.fit(x_train, y_train, batch_size=BATCH, epochs=max(1, round(STEPS * q)), verbose=0)

runs = {}
for name, sparse in (("dense", None), ("sparse", tf_dp.keras.SparseEmbeddingConfig(
        threshold=THRESHOLD, selection_noise_multiplier=SELECTION_NOISE_MULTIPLIER))):
    model = tf_dp.keras.make_private(make_model())
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=NOISE_MULTIPLIER if sparse is None else SIGMA2,
        learning_rate=DP_LEARNING_RATE, sparse_embeddings=sparse), loss=loss)
    model.fit(tf_dp.data.poisson_batches(x_train, y_train, sampling_probability=q,
                                         steps_per_epoch=STEPS), epochs=1, verbose=0)
    runs[name] = model

baseline_accuracy = accuracy(baseline)
epsilons = {k: compute_epsilon(m.optimizer.ledger, DELTA, ACCOUNTANT).epsilon for k, m in runs.items()}
accuracies = {k: accuracy(m) for k, m in runs.items()}
print(f"{'run':12}{'epsilon (' + ACCOUNTANT + ')':>15}{'test accuracy':>15}")
print(f"{'non-private':12}{'-':>15}{baseline_accuracy:>15.3f}")
for k in runs:
    print(f"{'DP ' + k:12}{epsilons[k]:>15.3f}{accuracies[k]:>15.3f}")

# %% [markdown]
# ## Accounting from the ledger file
#
# Every step records two sum queries of the same Poisson sample: the gradient's (sensitivity
# `C`, noise `sigma2 C`) and the selection's (sensitivity: the contribution bound `C1`, noise
# `sigma1 C1`). The threshold is not needed for the accounting (it is post-processing) and is
# saved in the file's metadata. The accountant composes both queries from the file alone.

# %%
import json
import tempfile

from tf_dp.ledger import read_ledger_file

path = os.path.join(tempfile.mkdtemp(), "sparse_ledger.json")
runs["sparse"].optimizer.ledger.save(path)
entries = read_ledger_file(path)
print("one step:", entries[0].sampling.policy, entries[0].sampling.selection_probability,
      [(e.l2_sensitivity, e.noise_stddev) for e in entries[0].queries])
with open(path) as f:
    print("metadata:", json.load(f)["metadata"])
file_epsilon = compute_epsilon(path, DELTA, ACCOUNTANT).epsilon
print(f"epsilon from the file ({ACCOUNTANT}): {file_epsilon:.3f} over {len(entries)} steps "
      f"(in memory: {epsilons['sparse']:.3f})")

# %% [markdown]
# ## The sparse update
#
# One more step of the sparse model, on a fixed batch (recorded in its ledger as a step of
# shuffled batches), watching the table: only the selected rows move. The rows
# the batch touched but the selection left out get nothing, and the rows nobody touched get
# nothing either (unless the noisy count of an empty row passed the threshold, which has
# probability `P(N(0, 1) > threshold / sigma1)` per row).

# %%
sparse_model = runs["sparse"]
table = sparse_model.get_layer("items").embeddings
before = table.numpy().copy()
batch_x, batch_y = x_train[:BATCH], y_train[:BATCH]
sparse_model.fit(batch_x, batch_y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
moved = np.flatnonzero(np.any(table.numpy() != before, axis=1))
in_batch = np.unique(batch_x)
print(f"the batch touched {len(in_batch)} of {ITEMS} rows; {len(moved)} rows moved, "
      f"{len(np.setdiff1d(moved, in_batch))} of them untouched by the batch")

# %% [markdown]
# ## Where it does not apply
#
# The number of selected rows changes from step to step, so the sparse step does not compile
# under XLA (`jit_compile=True` is refused, naming the option), nor run under a `tf.distribute`
# strategy; the tables must be looked up only (a tied `ReversibleEmbedding` also used as the
# output layer is refused), and the clip and noise must be fixed numbers.
