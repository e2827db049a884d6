# %% [markdown]
# # User-level DP: protecting people, not records
#
# Many private data sets hold several records per person. Example-level DP protects one record:
# a person with 20 records is protected far less than the epsilon says. User-level DP protects
# all the records of one user: tf_dp samples **users** (Poisson, rate `q`), takes at most `k`
# records of each sampled user, clips the **sum** of each user's gradients to `C`, and records
# the population and rate of users in the ledger, which then gives a user-level guarantee.
#
# This notebook trains the same model twice on a data set with many records per user, once at
# the example level and once at the user level, with the same noise multiplier, the same number
# of steps and about the same number of records per batch, and prints both epsilons side by side.

# %% [markdown]
# ## Parameters
#
# `SMALL` (the test suite sets `TF_DP_TUTORIAL_SMALL=1`) trains on 3,000 images for a few steps.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("TF_DP_TUTORIAL_SMALL", "0") == "1"

TRAIN_SIZE = 3000 if SMALL else None  # None: the whole training set
TEST_SIZE = 1000 if SMALL else None
RECORDS_PER_USER = 20  # average records of one (synthetic) user
K = 4  # at most K records of a sampled user per batch
RECORDS_PER_BATCH = 128 if SMALL else 256  # expected records per batch, in both runs
EPOCHS = 2 if SMALL else 10  # expected passes over the records (example-level run)
L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.1
LEARNING_RATE = 0.5
DELTA = 1e-5

# %% [markdown]
# ## Data: images grouped into users
#
# Fashion-MNIST (MNIST on Colab) images are dealt to synthetic users: each user gets the images
# of mostly one class, as a person's photos are mostly of their own things, with a random number
# of images (on average `RECORDS_PER_USER`). The labels and images are real; only the grouping
# into users is made up.

# %%
import numpy as np

import keras
import tf_dp
from tf_dp.data import load_mnist_or_fashion_mnist

(x_train, y_train), (x_test, y_test), data_name = load_mnist_or_fashion_mnist(
    data_dir=os.environ.get("TF_DP_TUTORIAL_DATA_DIR")
)
x_train = x_train[:TRAIN_SIZE].reshape(-1, 784).astype(np.float32) / 255.0
x_test = x_test[:TEST_SIZE].reshape(-1, 784).astype(np.float32) / 255.0
y_train, y_test = y_train[:TRAIN_SIZE].astype(np.int32), y_test[:TEST_SIZE].astype(np.int32)
n = len(x_train)

rng = np.random.default_rng(0)
n_users = n // RECORDS_PER_USER
favourite = rng.integers(0, 10, n_users)  # each user's usual class
user_ids = np.empty(n, np.int64)
for c in range(10):
    rows = np.flatnonzero(y_train == c)
    mostly = np.flatnonzero(favourite == c)
    owners = mostly if len(mostly) else np.arange(n_users)
    # 80% of a class's images go to the users whose usual class it is, the rest to anyone
    to_fans = rng.random(len(rows)) < 0.8
    anyone = rng.integers(0, n_users, len(rows))
    user_ids[rows] = np.where(to_fans, rng.choice(owners, len(rows)), anyone)
n_users = len(np.unique(user_ids))
counts = np.bincount(np.unique(user_ids, return_inverse=True)[1])
print(f"DATA: {data_name}: {n} training images of {n_users} users "
      f"({counts.min()} to {counts.max()} images per user, median {int(np.median(counts))})")

# %% [markdown]
# ## Two runs, same noise and steps
#
# - **Example-level**: every image joins a batch independently with probability
#   `q_ex = RECORDS_PER_BATCH / n`.
# - **User-level**: every user joins with probability `q_user`, with at most `K` of their images,
#   so a batch holds about `q_user * sum_u min(K, c_u)` images; `q_user` is chosen so that this
#   is `RECORDS_PER_BATCH`, as in the first run.
#
# Both run the same number of steps with the same noise multiplier. The user-level run clips the
# sum of each user's gradients (ghost clipping, no per-example gradients) and divides by the
# expected number of users per batch.

# %%
q_ex = RECORDS_PER_BATCH / n
q_user = min(1.0, RECORDS_PER_BATCH / float(np.minimum(counts, K).sum()))
steps = int(EPOCHS / q_ex)


def make_model():
    keras.utils.set_random_seed(1)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((784,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=L2_NORM_CLIP, noise_multiplier=NOISE_MULTIPLIER,
            learning_rate=LEARNING_RATE, gradient_mode="ghost"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    return model


example_model = make_model()
example_model.fit(tf_dp.data.poisson_batches(x_train, y_train, sampling_probability=q_ex,
                                             steps_per_epoch=steps), epochs=1, verbose=0)
user_model = make_model()
user_model.fit(tf_dp.data.poisson_batches(x_train, y_train, sampling_probability=q_user,
                                          user_ids=user_ids, max_records_per_user=K,
                                          steps_per_epoch=steps), epochs=1, verbose=0)
example_accuracy = example_model.evaluate(x_test, y_test, verbose=0)[1]
user_accuracy = user_model.evaluate(x_test, y_test, verbose=0)[1]

# %% [markdown]
# ## Side by side
#
# Each epsilon comes from the run's own ledger. The statement ends with what the ledger says
# about the claim: the unit (example or user) and who sampled (tf_dp here, for both runs).

# %%
from tf_dp.accounting import compute_epsilon

example_result = compute_epsilon(example_model.optimizer.ledger, DELTA, "pld")
user_result = compute_epsilon(user_model.optimizer.ledger, DELTA, "pld")
print(f"{'':14}{'n':>8}{'q':>10}{'steps':>8}{'epsilon (PLD)':>16}{'accuracy':>10}")
print(f"{'example-level':14}{n:>8}{q_ex:>10.4g}{steps:>8}{example_result.epsilon:>16.3f}"
      f"{example_accuracy:>10.3f}")
print(f"{'user-level':14}{n_users:>8}{q_user:>10.4g}{steps:>8}{user_result.epsilon:>16.3f}"
      f"{user_accuracy:>10.3f}")
claims = [tf_dp.accounting.sampling_claims(m.optimizer.ledger.runs())
          for m in (example_model, user_model)]
print()
print("example-level run:", claims[0])
print("user-level run:   ", claims[1])

# %% [markdown]
# **Reading the table.** The example-level epsilon protects one image; a user with 20 images is
# covered only by group privacy, whose bound grows about 20-fold in epsilon. The user-level
# epsilon protects everything a user contributed, whatever their number of images: `K` bounds
# the work per step and reaches the guarantee only through the clip (a user's clipped sum has
# norm at most `C` whatever `K` is). Its epsilon is larger for the same noise and steps because
# users are sampled at a higher rate than images (`q_user > q_ex`): there are fewer users than
# images.
