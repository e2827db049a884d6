# %% [markdown]
# # DP training from files: Poisson sampling from TFRecords, memmaps, and sequential pipelines
#
# The privacy guarantee tf_dp prints is computed from the ledger of what ran, and it is only as
# true as the sampling the ledger records. Poisson sampling (every record independently in every
# batch with probability `q`) gets *amplification by subsampling*, the reason DP-SGD's epsilons
# are small; but it needs random access to every record at every step. This notebook shows the
# three ways tf_dp samples data that is not (or need not be) in memory:
#
# - **TFRecord files** with `tf_dp.data.TFRecordSource` and `tf_dp.data.poisson_sample`: one
#   indexing pass over the files, then each step reads only its sampled records, by offset;
# - **memory-mapped arrays** with `tf_dp.data.ArraySource` (the same for HDF5 and ArrayRecord);
# - a **sequential `tf.data` pipeline** (no random access) with `tf_dp.data.shuffled_passes`:
#   fixed-size batches of full passes, accounted *without* amplification, and what a false
#   "poisson" declaration for such a pipeline would have printed.
#
# In each case the sampler tells `fit` its own sampling claim, so the ledger says "sampled by
# tf_dp" rather than "declared, not checked".

# %% [markdown]
# ## Parameters
#
# `SMALL` runs a quick version (a few thousand images, one epoch): the test suite uses it, with
# `TF_DP_TUTORIAL_SMALL=1`.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("TF_DP_TUTORIAL_SMALL", "0") == "1"

N_TRAIN = 3000 if SMALL else None  # None: the whole training set
BATCH_SIZE = 64  # expected batch size (Poisson) / batch size (shuffled passes)
EPOCHS = 1 if SMALL else 5
NOISE_MULTIPLIER = 1.1
DELTA = 1e-5

# %% [markdown]
# ## Data, written to TFRecord files
#
# Real data only: `load_mnist_or_fashion_mnist` tries MNIST through `keras.datasets` and
# otherwise reads Fashion-MNIST from Debian's `dataset-fashion-mnist` package
# (`TF_DP_TUTORIAL_DATA_DIR` points it at another directory of IDX files). We write the training
# images to 4 uncompressed TFRecord files of serialized `tf.train.Example`s, as a large data set
# would be stored.

# %%
import tempfile

import numpy as np
import tensorflow as tf

from tf_dp.data import load_mnist_or_fashion_mnist

(x_train, y_train), (x_test, y_test), data_name = load_mnist_or_fashion_mnist(
    data_dir=os.environ.get("TF_DP_TUTORIAL_DATA_DIR")
)
if N_TRAIN:
    x_train, y_train = x_train[:N_TRAIN], y_train[:N_TRAIN]
x_test = x_test.reshape(len(x_test), -1).astype(np.float32) / 255.0
n = len(x_train)

workdir = tempfile.mkdtemp(prefix="dp_large_data_")
paths = [os.path.join(workdir, f"train-{i}.tfrecord") for i in range(4)]
for path, rows in zip(paths, np.array_split(np.arange(n), 4)):
    with tf.io.TFRecordWriter(path) as writer:
        for i in rows:
            feature = {
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[x_train[i].tobytes()])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y_train[i])])),
            }
            writer.write(tf.train.Example(
                features=tf.train.Features(feature=feature)).SerializeToString())
print(f"{data_name}: {n} training images in {len(paths)} TFRecord files")

# %% [markdown]
# ## 1. Poisson sampling from TFRecord files
#
# `TFRecordSource` walks the record headers once and keeps one 8-byte offset per record; every
# read fetches a record by its offset and checks its CRC. `parse_fn` turns a batch of serialized
# records into numpy `(x, y)`. `poisson_sample` draws each step's sample (a Binomial size, then a
# uniform subset of that size: exactly Poisson sampling), reads those records in a background
# thread ahead of the training step, and pads the batch with zero-weight rows.

# %%
import keras

import tf_dp
import tf_dp.keras
from tf_dp.accounting import compute_epsilon, dp_sgd_epsilon
from tf_dp.data import TFRecordSource, poisson_sample

SPEC = {"image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64)}


def parse(serialized):
    features = tf.io.parse_example(serialized, SPEC)
    images = tf.io.decode_raw(features["image"], tf.uint8)
    return (tf.cast(images, tf.float32) / 255.0).numpy(), features["label"].numpy()


def private_model():
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((784,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=NOISE_MULTIPLIER, learning_rate=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    return model


source = TFRecordSource(paths, parse_fn=parse)
q = BATCH_SIZE / len(source)
print(f"{len(source)} records indexed ({source.index_bytes} bytes of index); q = {q:.4f}")

tfrecord_model = private_model()
tfrecord_batches = poisson_sample(source, sampling_probability=q)
print(tfrecord_batches.sampling.describe())
tfrecord_model.fit(tfrecord_batches, epochs=EPOCHS, verbose=0)
tfrecord_accuracy = tfrecord_model.evaluate(x_test, y_test, verbose=0)[1]
tfrecord_ledger = tfrecord_model.optimizer.ledger
tfrecord_result = compute_epsilon(tfrecord_ledger, DELTA)
print(f"test accuracy {tfrecord_accuracy:.3f}; {tfrecord_ledger.num_samples} steps; "
      f"epsilon {tfrecord_result.epsilon:.2f} at delta {DELTA:g}")

# %% [markdown]
# The ledger holds one entry per step with the sampling as it ran: the population is the number
# of records in the files, the rate is `q`, the policy `poisson`.

# %%
entry = tfrecord_ledger.samples()[0].sampling
print(entry.population_size, entry.selection_probability, entry.policy)

# %% [markdown]
# ## 2. Memory-mapped arrays
#
# Anything with `len` and integer-array indexing is a random-access source through `ArraySource`:
# a `np.memmap` (here, `np.load(..., mmap_mode="r")`), an h5py dataset (`hdf5_source`), and
# ArrayRecord files have their own adapter (`ArrayRecordSource`). Only the sampled rows are read.

# %%
from tf_dp.data import ArraySource

np.save(os.path.join(workdir, "x.npy"), x_train.reshape(n, -1).astype(np.float32) / 255.0)
np.save(os.path.join(workdir, "y.npy"), y_train.astype(np.int64))
x_disk = np.load(os.path.join(workdir, "x.npy"), mmap_mode="r")
y_disk = np.load(os.path.join(workdir, "y.npy"), mmap_mode="r")

memmap_model = private_model()
memmap_model.fit(poisson_sample(ArraySource(x_disk, y_disk), sampling_probability=q),
                 epochs=EPOCHS, verbose=0)
memmap_accuracy = memmap_model.evaluate(x_test, y_test, verbose=0)[1]
memmap_result = compute_epsilon(memmap_model.optimizer.ledger, DELTA)
print(f"test accuracy {memmap_accuracy:.3f}; epsilon {memmap_result.epsilon:.2f}")

# %% [markdown]
# ## 3. A sequential pipeline: shuffled passes, and the cost of a false claim
#
# `tf.data.TFRecordDataset` reads files in order: it cannot fetch a random record. A true Poisson
# sample of it would read the whole data set at every step. `shuffled_passes` batches one pass per
# epoch into fixed-size batches, checks every pass holds exactly `population_size` records, and
# records `shuffle` sampling: the bound without amplification (each record once per pass).

# %%
from tf_dp.data import shuffled_passes


def parse_one(serialized):
    features = tf.io.parse_single_example(serialized, SPEC)
    image = tf.cast(tf.io.decode_raw(features["image"], tf.uint8), tf.float32) / 255.0
    return tf.reshape(image, [784]), features["label"]


records = tf.data.TFRecordDataset(paths).map(parse_one)
shuffled_model = private_model()
shuffled_model.fit(shuffled_passes(records, population_size=n, batch_size=BATCH_SIZE,
                                   shuffle_buffer_size=n),
                   epochs=EPOCHS, verbose=0)
shuffled_accuracy = shuffled_model.evaluate(x_test, y_test, verbose=0)[1]
shuffled_ledger = shuffled_model.optimizer.ledger
shuffled_result = compute_epsilon(shuffled_ledger, DELTA)

# What declaring "poisson" for these same batches would have printed (a claim tf_dp cannot check):
declared_poisson = dp_sgd_epsilon(n, BATCH_SIZE, NOISE_MULTIPLIER, DELTA,
                                  steps=shuffled_ledger.num_samples)
print(f"shuffled passes: test accuracy {shuffled_accuracy:.3f}, {shuffled_ledger.num_samples} "
      f"steps; epsilon {shuffled_result.epsilon:.2f} (the run's bound, no amplification)")
print(f"the same run declared 'poisson': epsilon {declared_poisson.epsilon:.2f} (false)")

# %% [markdown]
# ## Summary
#
# Same model, noise and expected batch size; epsilon at `delta = 1e-5` from each run's ledger.

# %%
print(f"{'input':<40} {'sampling':<10} {'epsilon':>8} {'accuracy':>9}")
for name, policy, eps, acc in [
    ("TFRecord files, poisson_sample", "poisson", tfrecord_result.epsilon, tfrecord_accuracy),
    ("memmap arrays, poisson_sample", "poisson", memmap_result.epsilon, memmap_accuracy),
    ("TFRecordDataset, shuffled_passes", "shuffle", shuffled_result.epsilon, shuffled_accuracy),
]:
    print(f"{name:<40} {policy:<10} {eps:>8.2f} {acc:>9.3f}")

# %% [markdown]
# More in `docs/data.md`: HDF5 and ArrayRecord sources, multi-worker sharding, what each source
# checks (indices, a source whose length changes, CRCs), and the sampler's throughput.
