"""The ledger travels with a private model's weights, checked by a checksum, whatever the model's
``compile`` does: keras-hub tasks, models with their own ``compile``, tampered or corrupted
weights files, duplicate keys in ledger files, and ``make_private`` after a non-private fit."""

import json
import shutil
import zipfile

import h5py
import keras
import numpy as np
import pytest

import tf_dp
from tf_dp.keras import DPKerasAdamOptimizer, DPKerasSGDOptimizer, is_private, make_private
from tf_dp.ledger import LedgerFileError

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CLIP, SIGMA = 1.0, 1.1


class _CountBatches(keras.callbacks.Callback):
    """Counts the training batches that ran (independently of the ledger)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


def _data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def _dense_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = make_private(keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]))
    model.compile(
        optimizer=DPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=SIGMA, learning_rate=0.1),
        loss=LOSS,
    )
    return model


def _weights(model):
    return [w.numpy() for w in model.weights]


# -- keras-hub: a task whose compile is its own --------------------------------------------------


def _bert_task():
    import keras_hub  # the test extra installs it

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
        max_sequence_length=8,
    )
    return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)


def _bert_data(n=32):
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, 30, (n, 8)).astype("int32"),
        "segment_ids": np.zeros((n, 8), "int32"),
        "padding_mask": np.ones((n, 8), "int32"),
    }
    return x, rng.integers(0, 2, n)


def test_keras_hub_task_reloads_private_with_its_ledger(tmp_path):
    x, y = _bert_data()
    q, steps = 0.125, 4

    def batches(seed):
        return tf_dp.data.poisson_batches(
            x, y, sampling_probability=q, steps_per_epoch=steps, seed=seed)

    model = make_private(_bert_task())
    model.compile(  # run_eagerly: tracing the per-example step of BERT takes longer than 4 steps
        optimizer=DPKerasAdamOptimizer(l2_norm_clip=CLIP, noise_multiplier=SIGMA, learning_rate=1e-3),
        loss=LOSS, run_eagerly=True,
    )
    counter = _CountBatches()
    model.fit(batches(1), verbose=0, callbacks=[counter])
    assert counter.count == steps
    first = model.optimizer.ledger.samples()
    model.save(str(tmp_path / "task.keras"))
    model.save_weights(str(tmp_path / "task.weights.h5"))

    # load_model: the task's own compile (a plain Adam) does not replace the DP optimizer
    loaded = keras.saving.load_model(str(tmp_path / "task.keras"))
    assert is_private(loaded) and type(loaded).__name__ == "BertTextClassifier"
    assert isinstance(loaded.optimizer, tf_dp.keras.DPOptimizerMixin)
    assert loaded.optimizer.ledger.samples() == first
    for a, b in zip(_weights(model), _weights(loaded)):
        np.testing.assert_array_equal(a, b)
    loaded.fit(batches(2), verbose=0, callbacks=[counter])
    assert counter.count == 2 * steps
    entries = loaded.optimizer.ledger.samples()
    assert len(entries) == counter.count and entries[:steps] == first
    noise = float(np.float32(SIGMA * CLIP))  # as the step used it
    assert {(e.sampling.population_size, e.sampling.selection_probability, e.sampling.policy,
             e.queries[0].noise_stddev) for e in entries} == {(32, q, "poisson", noise)}

    # load_weights into a new private task (compiled by keras-hub with a plain Adam): a later
    # DP compile adopts the ledger the weights came with
    fresh = make_private(_bert_task())
    fresh.load_weights(str(tmp_path / "task.weights.h5"))
    fresh.compile(optimizer=DPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=SIGMA),
                  loss=LOSS, run_eagerly=True)
    assert fresh.optimizer.ledger.samples() == first
    fresh.optimizer.ledger.reset()  # the optimizer's ledger no longer covers the weights' steps
    with pytest.raises(ValueError, match=f"trained with {steps} DP steps"):
        fresh.fit(batches(3), verbose=0)


# -- a model whose compile is overridden --------------------------------------------------------


@keras.saving.register_keras_serializable(package="tf_dp_tests")
class OwnCompile(keras.Model):
    """Its ``compile`` has its own defaults, so Keras does not restore it on load."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    def compile(self, optimizer="sgd", loss=LOSS, **kwargs):
        super().compile(optimizer=optimizer, loss=loss, **kwargs)


def test_model_with_its_own_compile_reloads_private_with_its_ledger(tmp_path):
    x, y = _data()
    keras.utils.set_random_seed(0)
    model = make_private(OwnCompile())
    model.compile(optimizer=DPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=SIGMA))
    model.fit(x, y, batch_size=10, verbose=0)
    recorded = model.optimizer.ledger.samples()
    assert len(recorded) == 4
    path = str(tmp_path / "own.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert is_private(loaded) and isinstance(loaded, OwnCompile)
    assert loaded.optimizer.ledger.samples() == recorded
    loaded.fit(x, y, batch_size=10, verbose=0)
    assert loaded.optimizer.ledger.num_samples == 8
    # A plain model of the same class refuses the weights of a private one (the ledger has
    # nowhere to go); making it private first loads them with the ledger.
    plain = OwnCompile()
    plain(x[:1])
    with pytest.raises(ValueError, match="could not be loaded"):
        plain.load_weights(str(tmp_path / "own.keras"))
    target = make_private(OwnCompile())
    target(x[:1])
    target.load_weights(str(tmp_path / "own.keras"))
    target.compile(optimizer=DPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=SIGMA))
    assert target.optimizer.ledger.samples() == recorded


# -- the ledger copy in weights files is checksummed --------------------------------------------


def _scale_noise_column(path, copy, factor):
    """Multiplies the noise column of one stored ledger copy by ``factor`` (found by value)."""
    group = "vars" if copy == "model" else "optimizer/vars"
    with h5py.File(path, "r+") as f:
        table = f[group]["tf_dp_ledger_queries"][...]
        columns = [j for j in range(table.shape[1]) if np.allclose(table[:, j], SIGMA * CLIP)]
        assert columns, "no column holds the noise stddev"
        table[:, columns[0]] *= factor
        f[group]["tf_dp_ledger_queries"][...] = table


@pytest.mark.parametrize("copy", ["model", "optimizer"])
def test_a_tampered_ledger_in_a_weights_file_is_refused(tmp_path, copy):
    x, y = _data()
    model = _dense_model()
    model.fit(x, y, batch_size=10, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    _scale_noise_column(path, copy, 100.0)

    target = _dense_model(seed=1)
    target.fit(x, y, batch_size=20, verbose=0)  # 2 steps
    before, ledger = _weights(target), target.optimizer.ledger.samples()
    with pytest.raises(ValueError, match="checksum mismatch"):
        target.load_weights(path)
    for a, b in zip(before, _weights(target)):  # nothing was loaded
        np.testing.assert_array_equal(a, b)
    assert target.optimizer.ledger.samples() == ledger


def test_a_tampered_ledger_in_a_keras_file_is_refused(tmp_path):
    x, y = _data()
    model = _dense_model()
    model.fit(x, y, batch_size=10, verbose=0)
    path, edited = tmp_path / "m.keras", tmp_path / "edited.keras"
    model.save(str(path))
    weights = tmp_path / "model.weights.h5"
    with zipfile.ZipFile(path) as z:
        weights.write_bytes(z.read("model.weights.h5"))
        names = {n: z.read(n) for n in z.namelist() if n != "model.weights.h5"}
    with h5py.File(weights, "r") as f:
        copies = [c for c, g in (("model", "vars"), ("optimizer", "optimizer/vars"))
                  if "tf_dp_ledger_queries" in f[g]]
    for copy in copies:  # every copy of the ledger in the file
        _scale_noise_column(str(weights), copy, 100.0)
    with zipfile.ZipFile(edited, "w") as z:
        for name, data in names.items():
            z.writestr(name, data)
        z.writestr("model.weights.h5", weights.read_bytes())
    with pytest.raises(ValueError, match="checksum mismatch"):
        keras.saving.load_model(str(edited))


def test_a_corrupted_or_incomplete_ledger_copy_is_refused(tmp_path):
    x, y = _data()
    model = _dense_model()
    model.fit(x, y, batch_size=10, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    truncated, unchecked = str(tmp_path / "t.weights.h5"), str(tmp_path / "u.weights.h5")
    shutil.copy(path, truncated)
    shutil.copy(path, unchecked)
    with h5py.File(truncated, "r+") as f:  # the last step's sampling row is lost
        samples = f["vars"]["tf_dp_ledger_samples"][...]
        del f["vars"]["tf_dp_ledger_samples"]
        f["vars"].create_dataset("tf_dp_ledger_samples", data=samples[:-1])
    with h5py.File(unchecked, "r+") as f:  # a table lost: the ledger cannot be checked
        del f["vars"]["tf_dp_ledger_samples"]
    for bad, message in ((truncated, "checksum mismatch"), (unchecked, "incomplete")):
        target = _dense_model(seed=1)
        with pytest.raises(ValueError, match=message):
            target.load_weights(bad)
        assert target.optimizer.ledger.num_samples == 0
    target = _dense_model(seed=1)
    target.load_weights(path)  # the intact file loads
    assert target.optimizer.ledger.samples() == model.optimizer.ledger.samples()


def test_duplicate_keys_in_a_ledger_file_are_refused(tmp_path):
    x, y = _data()
    model = _dense_model()
    model.fit(x, y, batch_size=10, verbose=0)
    path = tmp_path / "ledger.json"
    model.optimizer.ledger.save(path)
    text = path.read_text()
    # A first "noise_stddev" before the real one: json keeps the last, so the checksum still
    # matches, but the file says two different things.
    edited = text.replace('"noise_stddev":', '"noise_stddev": 0.011, "noise_stddev":', 1)
    assert edited != text
    json.loads(edited)  # valid JSON for a reader that ignores duplicates
    path.write_text(edited)
    with pytest.raises(LedgerFileError, match="'noise_stddev' twice"):
        tf_dp.ledger.read_ledger_file(path)


# -- make_private after a non-private train function was built ----------------------------------


def test_make_private_after_a_refused_fit_trains_privately():
    x, y = _data()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile(optimizer=DPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=SIGMA),
                  loss=LOSS)
    with pytest.raises(RuntimeError, match="make_private"):
        model.fit(x, y, batch_size=10, verbose=0)
    model = make_private(model)  # what the error says
    counter = _CountBatches()
    model.fit(x, y, batch_size=10, verbose=0, callbacks=[counter])
    assert model.optimizer.ledger.num_samples == counter.count == 4


def test_make_private_after_non_private_training_trains_privately():
    x, y = _data()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=LOSS)
    model.fit(x, y, batch_size=10, verbose=0)  # a public warm-up, non-private
    model = make_private(model)
    model.compile(optimizer=DPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=0.0,
                                                learning_rate=0.1), loss=LOSS)
    before = _weights(model)
    counter = _CountBatches()
    model.fit(x, y, batch_size=10, verbose=0, callbacks=[counter])
    assert model.optimizer.ledger.num_samples == counter.count == 4
    # The update is the clipped one: with no noise, each step moves the weights by at most
    # learning_rate * clip (the mean of clipped gradients has norm <= clip).
    step = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(before, _weights(model))))
    assert 0 < step <= 4 * 0.1 * CLIP + 1e-6


def test_load_model_of_a_made_private_model_trains_on(tmp_path):
    x, y = _data()
    model = _dense_model()
    model.fit(x, y, batch_size=10, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert is_private(loaded)
    loaded.fit(x, y, batch_size=10, verbose=0)
    assert loaded.optimizer.ledger.num_samples == 8
