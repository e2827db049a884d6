"""Every file format tf_dp ever wrote loads (issue 33 items 2 and 7).

Fixtures in tests/data, each a tiny private model trained 3 steps (24 records, batches of 8):

- ``*_no_ledger_v0.keras``: saved by the code before commit c2fb504 (no ledger in the file);
- ``*_no_checksum_v1.keras``: saved by the code before commit 3b9dd89 (the ledger's two tables in
  the optimizer's variables, no checksum), generated with a ``git worktree`` of 3b9dd89^;
- the other ``*_v0.keras``: tables and checksum in the model's and the optimizer's variables.

Weights and iterations are read independently from the archive with h5py.
"""

import glob
import io
import os
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest

import tf_dp
import tf_dp.keras
from tf_dp.accounting import compute_delta, compute_epsilon
from tf_dp.ledger import LedgerFileError

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = sorted(glob.glob(os.path.join(HERE, "data", "*.keras")))


def _stored(path):
    """{h5 dataset path: array} of the archive's weights file, read without Keras."""
    with zipfile.ZipFile(path) as z:
        raw = z.read("model.weights.h5")
    out = {}
    with h5py.File(io.BytesIO(raw), "r") as f:
        f.visititems(
            lambda k, v: out.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset) else None
        )
    return out


def _load(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.saving.load_model(path)
    return model, [str(w.message) for w in caught if "ledger checksums" in str(w.message)]


def test_the_fixtures_cover_every_format():
    names = [os.path.basename(p) for p in FIXTURES]
    assert any("no_ledger" in n for n in names) and any("no_checksum" in n for n in names)
    assert any("tf_dp_ledger_sha256" in k for p in FIXTURES for k in _stored(p))


@pytest.mark.parametrize("path", FIXTURES, ids=os.path.basename)
def test_every_saved_format_loads(path):
    stored = _stored(path)
    model, unverified_warnings = _load(path)
    assert tf_dp.keras.is_private(model)
    # weights: equal to the saved ones, layer by layer (Keras names a model's Dense layers
    # "dense", "dense_1", ... in the file, in order)
    layers = [layer for layer in model.layers if layer.weights]
    assert all(type(layer).__name__ == "Dense" for layer in layers)
    for k, layer in enumerate(layers):
        group = "layers/dense" + (f"_{k}" if k else "")
        for i, w in enumerate(layer.weights):
            np.testing.assert_array_equal(w.numpy(), stored[f"{group}/vars/{i}"])
    opt = model.optimizer
    iterations = int(stored["optimizer/vars/0"])
    assert iterations == 3 == int(opt.iterations.numpy())
    ledger = opt.ledger
    has_tables = "optimizer/vars/tf_dp_ledger_samples" in stored
    has_checksum = "optimizer/vars/tf_dp_ledger_sha256" in stored
    if not has_tables:  # before the ledger travelled: trained steps, privacy spent unknown
        assert ledger.num_samples == 0 and ledger.missing_steps == iterations
        with pytest.raises(ValueError, match=f"ledger of {iterations} trained steps is missing"):
            compute_epsilon(ledger, 1e-5)
        return
    assert ledger.num_samples == iterations == len(stored["optimizer/vars/tf_dp_ledger_samples"])
    assert ledger.missing_steps == 0
    result = compute_epsilon(ledger, 1e-5)
    assert 0 < result.epsilon < float("inf")
    if has_checksum:
        assert ledger.verified and result.verified and not unverified_warnings
        assert "UNVERIFIED" not in str(result)
    else:
        assert not ledger.verified and not result.verified
        assert len(unverified_warnings) >= 1
        assert "before ledger checksums" in unverified_warnings[0]
        assert "could not be verified" in unverified_warnings[0]
        assert "UNVERIFIED LEDGER" in str(result) and result.to_dict()["verified"] is False
        assert "UNVERIFIED LEDGER" in str(compute_delta(ledger, 1.0))


def test_a_checksum_mismatch_still_raises_a_tf_dp_error(tmp_path):
    path = os.path.join(HERE, "data", "dp_sgd_v0.keras")
    edited = tmp_path / "edited.keras"
    weights = tmp_path / "model.weights.h5"
    with zipfile.ZipFile(path) as z:
        weights.write_bytes(z.read("model.weights.h5"))
        names = {n: z.read(n) for n in z.namelist() if n != "model.weights.h5"}
    with h5py.File(weights, "r+") as f:
        for group in ("vars", "optimizer/vars"):
            table = f[group]["tf_dp_ledger_queries"][...]
            f[group]["tf_dp_ledger_queries"][...] = table * 2.0
    with zipfile.ZipFile(edited, "w") as z:
        for name, data in names.items():
            z.writestr(name, data)
        z.writestr("model.weights.h5", weights.read_bytes())
    with pytest.raises(ValueError, match="tf_dp: ledger checksum mismatch") as e:
        keras.saving.load_model(str(edited))
    assert "read_ledger_file" in str(e.value)  # the way forward
    # a private model's load_weights raises tf_dp's own error, not Keras's generic one
    target = _private_model()
    target.optimizer.build(target.trainable_variables)
    before = [w.numpy().copy() for w in target.weights]
    with pytest.raises(LedgerFileError, match="^tf_dp: ledger checksum mismatch"):
        target.load_weights(str(edited))
    for a, w in zip(before, target.weights):  # nothing was loaded
        np.testing.assert_array_equal(a, w.numpy())
    assert target.optimizer.ledger.num_samples == 0


def _private_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = tf_dp.keras.DPSequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_trained_weights_without_their_ledger_never_read_as_nothing_spent(tmp_path):
    """Item 7: the three ledger datasets deleted from a .weights.h5 with h5py."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype("float32")
    y = rng.integers(0, 2, 40)
    model = _private_model()
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)  # 20 steps
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    with h5py.File(path, "r+") as f:
        iterations = int(f["optimizer/vars/0"][()])
        for group in ("vars", "optimizer/vars"):
            for key in ("tf_dp_ledger_samples", "tf_dp_ledger_queries", "tf_dp_ledger_sha256"):
                if key in f[group]:
                    del f[group][key]
    assert iterations == 20
    target = _private_model(seed=1)
    target.optimizer.build(target.trainable_variables)
    target.load_weights(path)
    assert int(target.optimizer.iterations.numpy()) == iterations
    ledger = target.optimizer.ledger
    assert ledger.num_samples == 0 and ledger.missing_steps == iterations
    with pytest.raises(ValueError, match="ledger of 20 trained steps is missing"):
        compute_epsilon(ledger, 1e-5)
    with pytest.raises(ValueError, match="ledger of 20 trained steps is missing"):
        compute_delta(ledger, 1.0)
    with pytest.raises(ValueError, match="ledger records only 0"):  # the next fit refuses
        target.fit(x, y, batch_size=4, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="lacks 20 of the 20 steps"):  # no laundering by file
        ledger.save(str(tmp_path / "ledger.json"))
    assert not (tmp_path / "ledger.json").exists()


def test_recompiling_keeps_a_missing_or_unverified_ledger_known(tmp_path):
    """A private model recompiled with a new DP optimizer continues the old ledger: steps the
    loaded weights were trained with but the ledger lacks stay missing, and an unverified
    ledger stays unverified (neither may read as a complete, verified account)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype("float32")
    y = rng.integers(0, 2, 40)
    model = _private_model()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 10 steps
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    with h5py.File(path, "r+") as f:
        for group in ("vars", "optimizer/vars"):
            for key in ("tf_dp_ledger_samples", "tf_dp_ledger_queries", "tf_dp_ledger_sha256"):
                if key in f[group]:
                    del f[group][key]
    target = _private_model(seed=1)
    target.optimizer.build(target.trainable_variables)
    target.load_weights(path)
    assert target.optimizer.ledger.missing_steps == 10
    target.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    target.optimizer.build(target.trainable_variables)
    assert target.optimizer.ledger.missing_steps == 10
    with pytest.raises(ValueError, match="ledger of 10 trained steps is missing"):
        compute_epsilon(target.optimizer.ledger, 1e-5)

    unverified = [p for p in FIXTURES if "no_checksum" in p]
    assert unverified, "the fixture saved before ledger checksums is missing"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = keras.saving.load_model(unverified[0])
    assert not old.optimizer.ledger.verified and old.optimizer.ledger.num_samples == 3
    old.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1
        ),
        loss="sparse_categorical_crossentropy",
    )
    old.optimizer.build(old.trainable_variables)
    ledger = old.optimizer.ledger
    assert ledger.num_samples == 3 and not ledger.verified
    assert not compute_epsilon(ledger, 1e-5).verified
