"""DP-SGD on MNIST (or Fashion-MNIST) with Keras 3, Poisson-sampled batches and a privacy ledger.

Trains the CNN of Bu et al. 2019 (two convolutions, one hidden dense layer) with DP-SGD: every
step samples each training example independently with probability ``q = batch_size / n``
(Poisson sampling, so privacy amplification by subsampling applies), clips each example's gradient
to ``l2_norm_clip``, adds Gaussian noise of stddev ``noise_multiplier * l2_norm_clip`` and takes an
SGD step. The optimizer records every step in its ledger; the script saves the ledger, loads the
saved file back and prints the privacy guarantee the accountant computes from it.

Data: MNIST through ``keras.datasets`` when it can be downloaded (or is cached); otherwise
Fashion-MNIST from ``--data_dir`` or ``/usr/share/datasets/fashion-mnist`` (Debian package
``dataset-fashion-mnist``). The log says which. Never synthetic.

Quick run (README's main command; about a minute on a 2-core CPU, 25 s of it training)::

    python tutorials/mnist_dpsgd_tutorial_keras.py --epochs 3 --ledger_path out/ledger.json

The first output line gives the TensorFlow and Keras versions and the devices; TensorFlow's own
start-up lines are filtered (:func:`import_tensorflow_quietly`) unless ``TF_CPP_MIN_LOG_LEVEL``
is set.

Defaults follow the first row of Bu et al. 2019, Table 1 (clip 1.5, sigma 1.3, q = 256/60000,
15 epochs; 95% on MNIST there) with a learning rate of 0.5 instead of 0.25, which learns faster
in short runs (one epoch on Fashion-MNIST here: 71% test accuracy vs 61%).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

# TensorFlow's C++ log level: a value the user set is kept (and then nothing is filtered below).
_USER_TF_LOG_LEVEL = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

#: Lines TensorFlow, Keras and matplotlib print while they load that say nothing about this run:
#: CUDA probing on a machine without a GPU driver, the oneDNN notice, absl's notice that C++ logs
#: go to stderr before its logging starts, matplotlib's one-time font cache (Keras imports it).
#: The script prints one line of its own instead: the versions and the devices TensorFlow found.
STARTUP_NOISE = (
    "All log messages before absl::InitializeLog() is called",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "failed call to cuInit",
    "Unable to register cuDNN factory",
    "Unable to register cuFFT factory",
    "Unable to register cuBLAS factory",
    "computation placer already registered",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "To enable the following instructions",
    "TF-TRT Warning: Could not find TensorRT",
    "Matplotlib is building the font cache",
)

FLAGS = flags.FLAGS
flags.DEFINE_float("learning_rate", 0.5, "SGD learning rate.")
flags.DEFINE_float("noise_multiplier", 1.3, "sigma: noise stddev / l2_norm_clip.")
flags.DEFINE_float("l2_norm_clip", 1.5, "Per-example gradient L2 clip C.")
flags.DEFINE_integer(
    "batch_size", 256, "Expected batch size: Poisson sampling with q = batch_size / train_size."
)
flags.DEFINE_integer("epochs", 15, "Epochs (an epoch is round(1/q) steps).")
flags.DEFINE_float("delta", 1e-5, "delta of the (epsilon, delta) guarantee.")
flags.DEFINE_enum(
    "accountant", "rdp", ["rdp", "pld"], "Accountant for the privacy statement (both certified)."
)
flags.DEFINE_string(
    "gradient_mode", "auto", "Per-example gradient strategy: auto, vectorized, microbatch, ..."
)
flags.DEFINE_integer(
    "num_microbatches",
    None,
    "Microbatches of randomly assigned examples, sensitivity 2C (gradient_mode microbatch or "
    "auto); None: clip each example.",
)
flags.DEFINE_string(
    "data_dir", None, "Directory with Fashion-MNIST IDX files (skips the MNIST download)."
)
flags.DEFINE_boolean("try_mnist", True, "Try to download MNIST through keras.datasets first.")
flags.DEFINE_string("ledger_path", "out/ledger.json", "Where to save the privacy ledger.")
flags.DEFINE_integer(
    "train_size", None, "Use only the first N training examples (quick runs); n = N for q."
)
flags.DEFINE_integer("test_size", None, "Evaluate on only the first N test examples.")
flags.DEFINE_integer("seed", None, "Seeds weights, noise and sampling: tests/debugging ONLY.")


def import_tensorflow_quietly() -> str:
    """Imports TensorFlow and Keras with their start-up lines (:data:`STARTUP_NOISE`) filtered out
    of stderr; every other line they print still reaches stderr. Returns a one-line summary of
    the versions and devices.

    With ``TF_CPP_MIN_LOG_LEVEL`` set by the user, nothing is filtered (``TF_CPP_MIN_LOG_LEVEL=0``
    shows everything TensorFlow prints).
    """
    captured = b""
    if _USER_TF_LOG_LEVEL is None:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                import keras
                import tensorflow as tf

                gpus = tf.config.list_physical_devices("GPU")  # device probing prints too
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                tmp.seek(0)
                captured = tmp.read()
    else:
        import keras
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
    for line in captured.decode(errors="replace").splitlines():
        if line.strip() and not any(pattern in line for pattern in STARTUP_NOISE):
            sys.stderr.write(line + "\n")
    sys.stderr.flush()
    devices = f"{len(gpus)} GPU(s)" if gpus else "CPU only (TensorFlow found no GPU)"
    return f"TensorFlow {tf.__version__}, Keras {keras.__version__}; devices: {devices}"


def build_cnn():
    """The reference CNN of Bu et al. 2019 (docs/architecture.md): 28x28x1 -> 10 logits."""
    import keras

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
        ],
        name="bu2019_cnn",
    )


def privacy_statement(ledger_path: str, delta: float, accountant: str) -> tuple[float, str]:
    """Loads the saved ledger file and runs the accountant on it."""
    from tf_dp import accounting

    result = accounting.compute_epsilon(ledger_path, delta=delta, accountant=accountant)
    return float(result.epsilon), str(result)


def main(argv):
    del argv
    print(import_tensorflow_quietly(), flush=True)
    import keras
    import numpy as np

    import tf_dp
    from tf_dp.data import DEBIAN_FASHION_MNIST_DIR, load_mnist_or_fashion_mnist

    if FLAGS.seed is not None:
        logging.warning("--seed set: sampling and noise are reproducible (tests/debugging only)")
        keras.utils.set_random_seed(FLAGS.seed)

    (x_train, y_train), (x_test, y_test), name = load_mnist_or_fashion_mnist(
        data_dir=FLAGS.data_dir, try_mnist=FLAGS.try_mnist
    )
    if FLAGS.train_size is not None:
        x_train, y_train = x_train[: FLAGS.train_size], y_train[: FLAGS.train_size]
    if FLAGS.test_size is not None:
        x_test, y_test = x_test[: FLAGS.test_size], y_test[: FLAGS.test_size]
    x_train = (x_train.astype(np.float32) / 255.0)[..., None]
    x_test = (x_test.astype(np.float32) / 255.0)[..., None]
    y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)
    n = len(x_train)
    q = min(1.0, FLAGS.batch_size / n)
    source = (
        "MNIST via keras.datasets"
        if name == "mnist"
        else f"Fashion-MNIST IDX files from {FLAGS.data_dir or DEBIAN_FASHION_MNIST_DIR}"
    )
    if name != "mnist" and FLAGS.data_dir is None and FLAGS.try_mnist:
        source += "; MNIST could not be downloaded"
    print(f"Data: {name} ({source}), {n} training / {len(x_test)} test examples", flush=True)

    batches = tf_dp.data.poisson_batches(
        x_train, y_train, sampling_probability=q, seed=FLAGS.seed
    )
    print(
        f"Poisson sampling: q = {FLAGS.batch_size}/{n} = {q:.5f}, {batches.steps_per_epoch} steps "
        f"per epoch, batches padded to {batches.max_batch_size}",
        flush=True,
    )
    model = tf_dp.keras.make_private(build_cnn())
    optimizer = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=FLAGS.l2_norm_clip,
        noise_multiplier=FLAGS.noise_multiplier,
        learning_rate=FLAGS.learning_rate,
        gradient_mode=FLAGS.gradient_mode,
        num_microbatches=FLAGS.num_microbatches,
        noise_seed=FLAGS.seed,
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    start = time.time()
    model.fit(batches, epochs=FLAGS.epochs, verbose=2)
    train_time = time.time() - start
    _, accuracy = model.evaluate(x_test, y_test, batch_size=1000, verbose=0)

    ledger_dir = os.path.dirname(os.path.abspath(FLAGS.ledger_path))
    os.makedirs(ledger_dir, exist_ok=True)
    optimizer.ledger.save(
        FLAGS.ledger_path,
        metadata={
            "script": "tutorials/mnist_dpsgd_tutorial_keras.py",
            "data": name,
            "epochs": FLAGS.epochs,
            "learning_rate": FLAGS.learning_rate,
            "batch_size": FLAGS.batch_size,
            "test_accuracy": float(accuracy),
        },
    )
    epsilon, statement = privacy_statement(FLAGS.ledger_path, FLAGS.delta, FLAGS.accountant)
    print(f"Trained on {name} for {FLAGS.epochs} epoch(s) in {train_time:.0f} s "
          f"({optimizer.ledger.num_samples} DP steps)")
    print(f"Test accuracy ({name}): {accuracy:.4f}")
    print(f"Ledger saved to {FLAGS.ledger_path}")
    print(f"Privacy (from the saved ledger): {statement}")
    print(f"epsilon = {epsilon:.4g} at delta = {FLAGS.delta:g}")


if __name__ == "__main__":
    app.run(main)
