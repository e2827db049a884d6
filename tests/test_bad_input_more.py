"""Adversarial inputs (issue 23, items 7-9): each bad input fails with a clear error that names
the argument or the layer, before anything runs or is recorded; what must be accepted is.

Countable structure: ``BAD_INPUTS`` (in-process) and ``BACKENDS`` (subprocesses) are tables of
one bad input each, with the expected error type and a message fragment; a traceback of another
type, or a message without the fragment, fails the test. The other tests check that the refusals
leave weights and ledger as they were, and that the batch-mixing probe raises no false alarm.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
import tf_dp.data.poisson
import tf_dp.keras as dpk
from bench import models as reference
from tf_dp.keras import batch_mixing
from tf_dp.keras import callbacks as dpcb
from tests.helpers import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MSE = "mse"


class BatchMean(keras.layers.Layer):
    """Subtracts the batch mean: every record's output depends on every other record."""

    def call(self, x):
        return x - tf.reduce_mean(x, axis=0, keepdims=True)


class TrainingBatchMean(keras.layers.Layer):
    """Mixes records in training only (as BatchNormalization does)."""

    def call(self, x, training=False):
        return x - tf.reduce_mean(x, axis=0, keepdims=True) if training else x


class MixingSubclass(keras.Model):
    def __init__(self):
        super().__init__(name="mixing_sub")
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x - tf.reduce_mean(x, axis=0))


def sgd(**kw):
    return dpk.DPKerasSGDOptimizer(
        **{"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "learning_rate": 0.1, **kw})


def xy(n=16, d=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def dense_with(*middle, name=None):
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), *middle,
                             keras.layers.Dense(2)], name=name)


def fit_private(model, x=None, y=None, **fit_kw):
    model = dpk.make_private(model)
    model.compile(optimizer=sgd(), loss=MSE)
    if x is None:
        x, y = xy()
    fit_kw.setdefault("batch_size", 8)
    model.fit(x, y, verbose=0, epochs=1, **fit_kw)
    return model


def nested_mixing():
    inp = keras.Input((5,))
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), BatchMean(name="deep_bm")],
                             name="inner")
    return keras.Model(inp, keras.layers.Dense(2)(inner(keras.layers.Dense(4)(inp))))


def many_batchnorms(k=53):
    layers = [keras.Input((5,))]
    for i in range(k):
        layers += [keras.layers.Dense(5), keras.layers.BatchNormalization(name=f"bn_{i}")]
    return keras.Sequential(layers + [keras.layers.Dense(2)])


def stateful_lstm():
    return keras.Sequential([keras.Input((3, 2), batch_size=4),
                             keras.layers.LSTM(3, stateful=True, name="st_lstm"),
                             keras.layers.Dense(1)])


def ragged_fit():
    model = dpk.make_private(keras.Sequential([
        keras.Input((None,), dtype="int32"), keras.layers.Embedding(10, 4),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)]))
    model.compile(optimizer=sgd(), loss=MSE)
    model.fit(tf.ragged.constant([[1, 2], [3], [4, 5, 6], [1]]), np.zeros((4, 2)), batch_size=2,
              verbose=0)


def poisson(x, y=None, **kw):
    return lambda: tf_dp.data.poisson_batches(x, y, **kw)


DATASET = tf.data.Dataset.from_tensor_slices(np.zeros((4, 3), "float32")).batch(2)

#: (id, call, expected exception type, fragment of the message)
BAD_INPUTS = [
    # item 9: numpy scalars are numbers, checked like Python numbers
    ("clip np.float32 nan", lambda: sgd(l2_norm_clip=np.float32("nan")), ValueError, "l2_norm_clip"),
    ("clip np.float32 0", lambda: sgd(l2_norm_clip=np.float32(0)), ValueError, "l2_norm_clip"),
    ("clip np.int64 -1", lambda: sgd(l2_norm_clip=np.int64(-1)), ValueError, "l2_norm_clip"),
    ("noise np.float32 -1", lambda: sgd(noise_multiplier=np.float32(-1)), ValueError,
     "noise_multiplier"),
    ("noise np.float16 inf", lambda: sgd(noise_multiplier=np.float16("inf")), ValueError,
     "noise_multiplier"),
    ("clip np.bool_", lambda: sgd(l2_norm_clip=np.bool_(True)), TypeError, "l2_norm_clip"),
    ("clip 1-d array", lambda: sgd(l2_norm_clip=np.array([1.0])), TypeError, "l2_norm_clip"),
    ("ftrl noise np.float32 -1",
     lambda: dpk.DPKerasFTRLOptimizer(l2_norm_clip=1.0, noise_multiplier=np.float32(-1)),
     ValueError, "noise_multiplier"),
    # item 9: ragged inputs are called ragged, not "a scalar"
    ("poisson ragged tensor", poisson(tf.ragged.constant([[1, 2], [3]]), np.zeros(2),
                                      sampling_probability=0.5), TypeError, "RaggedTensor"),
    ("poisson ragged list", poisson([[1, 2], [3]], np.zeros(2), sampling_probability=0.5),
     ValueError, "ragged"),
    ("poisson list of scalars", poisson([1.0, 2.0], np.zeros(2), sampling_probability=0.5),
     ValueError, "np.asarray"),
    ("poisson ragged y", poisson(np.zeros((2, 3)), tf.ragged.constant([[1], [2, 3]]),
                                 sampling_probability=0.5), TypeError, "y must be rectangular"),
    ("fit ragged x", ragged_fit, ValueError, "x holds a RaggedTensor"),
    # item 9: poisson_batches(dataset) names the real reason first
    ("poisson dataset, no y", poisson(DATASET, sampling_probability=0.5), TypeError,
     "tf.data.Dataset"),
    ("poisson dataset, nothing else", poisson(DATASET), TypeError, "tf.data.Dataset"),
    # item 9: stateful RNNs refused by tf_dp, naming the layer
    ("stateful LSTM make_private", lambda: dpk.make_private(stateful_lstm()), ValueError,
     "'st_lstm'"),
    ("stateful LSTM DPSequential fit",
     lambda: fit_private(dpk.DPSequential(stateful_lstm().layers),
                         np.zeros((8, 3, 2), "float32"), np.zeros((8, 1)), batch_size=4),
     ValueError, "stateful recurrent layer(s): 'st_lstm'"),
    # item 9: every BatchNormalization counted, the first five named
    ("53 BatchNormalization", lambda: dpk.make_private(many_batchnorms()), ValueError,
     "53 layer(s) mix the examples of a batch (BatchNormalization): 'bn_0', 'bn_1', 'bn_2', "
     "'bn_3', 'bn_4' and 48 more"),
    # item 8: layers that mix the records of a batch, found by the probe at fit
    ("batch mean layer", lambda: fit_private(dense_with(BatchMean(name="bm"))), ValueError,
     "layer 'bm' (BatchMean) mixes the records"),
    ("training-only batch mean next to dropout",
     lambda: fit_private(dense_with(keras.layers.Dropout(0.5), TrainingBatchMean(name="tbm"))),
     ValueError, "'tbm'"),
    ("batch mean in a nested model", lambda: fit_private(nested_mixing()), ValueError,
     "layer 'deep_bm' (BatchMean) in layer 'inner'"),
    ("subclassed model mixing", lambda: fit_private(MixingSubclass()), ValueError,
     "model 'mixing_sub'"),
    ("batch mean, Poisson batches",
     lambda: fit_private(dense_with(BatchMean(name="bmp")),
                         tf_dp.data.poisson_batches(*xy(), sampling_probability=0.5, seed=1),
                         batch_size=None), ValueError, "'bmp'"),
    ("batch mean, tf.data input", lambda: _fit_dataset(BatchMean(name="bmd")), ValueError,
     "'bmd'"),
    # issue 35: every layer frozen (keras-hub's enable_lora matching no layer): not AddN's error
    ("no trainable variables", lambda: fit_private(frozen()), ValueError,
     "the model has no trainable variables"),
]


def frozen():
    model = dense_with()
    model.trainable = False
    return model


def _fit_dataset(layer):
    model = dpk.make_private(dense_with(layer))
    model.compile(optimizer=sgd(), loss=MSE)
    model.optimizer.set_sampling(16, 0.5, "shuffle")
    model.fit(tf.data.Dataset.from_tensor_slices(xy()).batch(8), verbose=0)


@pytest.mark.parametrize("call,exc,fragment", [row[1:] for row in BAD_INPUTS],
                         ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_fails_with_a_clear_error(call, exc, fragment):
    with pytest.raises(exc) as err:
        call()
    assert fragment in str(err.value)


#: Keras backends other than TensorFlow (numpy stands in for "any other": it needs no GPU).
BACKENDS = ["jax", "numpy"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_keras_backend_is_refused_at_import_in_one_line(backend):
    code = (
        "import sys, tf_dp, tf_dp.accounting as acc\n"
        "eps = acc.dp_sgd_epsilon(1000, 10, 1.1, 1e-5, steps=100).epsilon\n"
        "tf_free = 'tensorflow' not in sys.modules\n"
        "try:\n"
        "    tf_dp.make_private\n"
        "    print('ACCEPTED')\n"
        "except ImportError as e:\n"
        "    print('REFUSED', repr(str(e)), eps, tf_free)\n"
    )
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    line = [l for l in p.stdout.splitlines() if l.startswith(("REFUSED", "ACCEPTED"))][-1]
    assert line.startswith("REFUSED"), line
    message = line.split(" ", 1)[1]
    assert "TensorFlow backend" in message and f"'{backend}'" in message
    assert "KERAS_BACKEND=tensorflow" in message and "\\n" not in message
    # the accounting side still works under that backend, without TensorFlow
    _, eps, tf_free = line.rsplit(" ", 2)
    from tf_dp import accounting as acc

    assert float(eps) == pytest.approx(acc.dp_sgd_epsilon(1000, 10, 1.1, 1e-5, steps=100).epsilon)
    assert tf_free == "True"


def test_numpy_scalars_for_clip_and_noise_give_the_python_numbers_values():
    opt = sgd(l2_norm_clip=np.float32(0.7), noise_multiplier=np.int64(2))
    assert opt.l2_norm_clip == float(np.float32(0.7)) and opt.noise_multiplier == 2
    model = fit_private(dense_with(), *xy(8))
    model.compile(optimizer=opt, loss=MSE)
    model.fit(*xy(8), batch_size=8, verbose=0)
    (entry,) = opt.ledger.samples()[-1:]
    (query,) = entry.queries
    # the float32 clip and stddev the step used: 0.7 (float32) and 2 * 0.7
    assert query.l2_sensitivity == pytest.approx(0.7, rel=1e-6)
    assert query.noise_stddev == pytest.approx(1.4, rel=1e-6)
    ftrl = dpk.DPKerasFTRLOptimizer(l2_norm_clip=np.float64(1.5), noise_multiplier=np.float32(1))
    assert ftrl.l2_norm_clip == 1.5


def test_cli_json_writes_an_infinite_epsilon_unambiguously():
    p = subprocess.run(
        [sys.executable, "-m", "tf_dp.cli.compute_dp_sgd_privacy", "--N=1000", "--batch_size=10",
         "--noise_multiplier=0", "--steps=10", "--delta=1e-5", "--format=json",
         "--accountant=rdp"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    # no noise: no finite epsilon holds at any delta < 1
    assert out["rdp"]["epsilon"] == "Infinity" and float(out["rdp"]["epsilon"]) == float("inf")


# --- the batch-mixing probe: refusals change nothing; no false alarms ------------------------


def test_probe_refusal_leaves_weights_ledger_and_random_state_as_they_were():
    model = dpk.make_private(dense_with(keras.layers.Dropout(0.3), BatchMean(name="bm")))
    model.compile(optimizer=sgd(), loss=MSE)
    model.build((None, 5))
    before = [v.numpy().copy() for v in model.variables]
    with pytest.raises(ValueError, match="'bm'"):
        model.fit(*xy(), batch_size=8, verbose=0)
    after = [v.numpy() for v in model.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # seed state included
    assert model.optimizer.ledger.samples() == [] and int(model.optimizer.iterations) == 0


def test_probe_finds_batch_normalization_by_behaviour():
    # The probe alone (BatchNormalization is also refused by type, before it): in training
    # mode BatchNormalization normalises with the batch's statistics.
    model = dense_with(keras.layers.BatchNormalization(name="the_bn"))
    with pytest.raises(ValueError, match="layer 'the_bn' \\(BatchNormalization\\)"):
        batch_mixing.check_batch_independence(model, xy(8)[0])


@pytest.mark.parametrize("name", ["cnn", "mlp", "lstm", "transformer"])
def test_probe_accepts_the_reference_models(name):
    model = reference.build_model(name)
    x, _ = reference.make_batch(name, 8)
    assert batch_mixing.check_batch_independence(model, x) is True


class RandomNoise(keras.layers.Layer):
    """Random beyond Keras's seed generators (tf.random): two identical passes differ."""

    def call(self, x, training=False):
        return x + tf.random.uniform(tf.shape(x)) if training else x


def _masked_sequence_model():
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    h = keras.layers.MultiHeadAttention(2, 4)(h, h)
    h = keras.layers.LSTM(4)(h)
    return keras.Model(tokens, keras.layers.Dense(2)(h))


ACCEPTED = {
    "dropout": lambda: dense_with(keras.layers.Dropout(0.5)),
    "gaussian noise": lambda: dense_with(keras.layers.GaussianNoise(1.0)),
    "group and layer norm": lambda: dense_with(keras.layers.LayerNormalization(),
                                               keras.layers.GroupNormalization(2)),
    "tf.random in training": lambda: dense_with(RandomNoise()),
    "masked attention + LSTM": _masked_sequence_model,
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_probe_accepts_models_that_keep_records_apart(name):
    model = dpk.make_private(ACCEPTED[name]())
    model.compile(optimizer=sgd(), loss=MSE)
    if name == "masked attention + LSTM":
        x = np.random.default_rng(0).integers(1, 20, (16, 6)).astype("int32")
        x[::2, 3:] = 0  # padded sequences
    else:
        x = xy()[0]
    # Poisson batches: padding rows (weight 0) are left out of the probe
    model.fit(tf_dp.data.poisson_batches(x, xy()[1], sampling_probability=0.5, seed=3),
              verbose=0)
    assert len(model.optimizer.ledger.samples()) == 2


def test_probe_runs_once_per_model_and_not_in_the_compiled_step(monkeypatch):
    calls = []
    real = batch_mixing.find_batch_mixing
    monkeypatch.setattr(batch_mixing, "find_batch_mixing",
                        lambda *a: calls.append(1) or real(*a))
    model = dpk.make_private(dense_with())
    model.compile(optimizer=sgd(), loss=MSE, jit_compile=True)
    for _ in range(2):
        model.fit(*xy(), batch_size=8, verbose=0)
    assert len(calls) == 1 and len(model.optimizer.ledger.samples()) == 4
    mixing = dpk.make_private(dense_with(BatchMean(name="bmx")))
    mixing.compile(optimizer=sgd(), loss=MSE, jit_compile=True)
    with pytest.raises(ValueError, match="'bmx'"):
        mixing.fit(*xy(), batch_size=8, verbose=0)


def test_probe_under_mirrored_strategy():
    code = (
        "import tensorflow as tf\n"
        "tf.config.set_logical_device_configuration(tf.config.list_physical_devices('CPU')[0],"
        " [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "import sys; sys.path.insert(0, 'tests')\n"
        "import keras, numpy as np, tf_dp.keras as dpk\n"
        "from test_bad_input_more import BatchMean, dense_with, sgd, xy\n"
        "strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])\n"
        "with strategy.scope():\n"
        "    ok = dpk.make_private(dense_with()); ok.compile(optimizer=sgd(), loss='mse')\n"
        "    bad = dpk.make_private(dense_with(BatchMean(name='bm_m')))\n"
        "    bad.compile(optimizer=sgd(), loss='mse')\n"
        "ok.fit(*xy(), batch_size=8, verbose=0)\n"
        "try:\n"
        "    bad.fit(*xy(), batch_size=8, verbose=0); print('ACCEPTED')\n"
        "except ValueError as e:\n"
        "    print('REFUSED', str(e).split(' mixes')[0], len(bad.optimizer.ledger.samples()))\n"
        "print('TRAINED', len(ok.optimizer.ledger.samples()))\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = warm_python.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "REFUSED layer 'bm_m' (BatchMean) 0" in p.stdout, p.stdout  # nothing recorded
    assert "TRAINED 2" in p.stdout, p.stdout


# -- issue 34, items 3, 4, 6 and 7: bounded resources and clear errors, before anything runs --


def _never(*args, **kwargs):
    raise AssertionError("called although the arguments should have been refused")


def _audit(**kw):
    from tf_dp.auditing import audit_dp_sgd

    x, y = xy(100)
    return lambda: audit_dp_sgd(_never, _never, x, y, loss=MSE, **kw)


def _ledger_file_with_population(tmp_path, population):
    # a well-formed, correctly signed ledger file whose one run claims `population` records
    import hashlib

    from tf_dp.ledger.ledger_file import _canonical

    body = {"format": "tf_dp.privacy_ledger", "version": 1, "num_samples": 5, "runs": [
        {"count": 5, "sampling": {"population_size": population, "selection_probability": 0.01,
                                  "policy": "poisson"},
         "queries": [{"l2_sensitivity": 1.0, "noise_stddev": 1.0, "mechanism": "gaussian",
                      "jl_projections": None}]}], "metadata": {}}
    body["sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(body))
    return str(path)


def _report_file(tmp_path, data: bytes):
    from tf_dp.auditing.report_file import read_report_file

    path = tmp_path / "audit.json"
    path.write_bytes(data)
    return lambda: read_report_file(str(path))


#: (id, call, exception type, fragment); `tmp_path` calls take it as their argument
BOUNDS = [
    # item 3: an audit of 10**9 canaries needs ~1e19 bytes; refused before any model is built
    ("audit 1e9 canaries", _audit(num_canaries=10**9), ValueError, "num_canaries must be in [2, "),
    ("audit 1e12 steps", _audit(steps=10**12), ValueError, "steps must be in [1, "),
    # item 6: integers beyond int64 / the ledger's float64 counts
    ("poisson q=1e-300", poisson(*xy(), sampling_probability=1e-300), ValueError,
     "sampling_probability=1e-300 gives a default steps_per_epoch"),
    ("poisson steps 1e30", poisson(*xy(), sampling_probability=0.5, steps_per_epoch=10**30),
     ValueError, "steps_per_epoch must be None or an integer >= 1 and <= 2**63 - 1"),
    ("set_sampling 1e30", lambda: sgd().set_sampling(10**30, 0.01, "poisson"), ValueError,
     "population_size must be an integer >= 1 and <= 2**53"),
    # item 7: silently accepted before
    ("validate_for_dp(42)", lambda: dpk.validate_for_dp(42), TypeError,
     "model must be a Keras model"),
    ("epsilon_from_rdp negative",
     lambda: tf_dp.accounting.epsilon_from_rdp([2.0, 4.0], [0.5, -1.0], 1e-5), ValueError,
     "rdp must hold Renyi divergences, numbers >= 0"),
    ("delta_from_rdp nan",
     lambda: tf_dp.accounting.delta_from_rdp([2.0, 4.0], [float("nan"), 1.0], 1.0), ValueError,
     "rdp must hold Renyi divergences"),
    ("default_max_batch_size(0)",
     lambda: tf_dp.data.poisson.default_max_batch_size(0, 0.5), ValueError,
     "population_size must be an integer >= 1"),
    ("default_max_batch_size q=0",
     lambda: tf_dp.data.poisson.default_max_batch_size(100, 0.0), ValueError,
     "sampling_probability must be in (0, 1]"),
    # item 6: LedgerCheckpoint refuses in its constructor
    ("LedgerCheckpoint empty path", lambda: dpcb.LedgerCheckpoint(""), ValueError,
     "filepath must be a non-empty path"),
    ("LedgerCheckpoint {}", lambda: dpcb.LedgerCheckpoint("l-{}.json"), ValueError,
     "every {field} must be a name"),
    ("LedgerCheckpoint open brace", lambda: dpcb.LedgerCheckpoint("l-{epoch.json"), ValueError,
     "not a valid format string"),
    ("LedgerCheckpoint bad spec", lambda: dpcb.LedgerCheckpoint("l-{epoch:q}.json"), ValueError,
     "format specs do not apply"),
    ("LedgerCheckpoint NaN metadata",
     lambda: dpcb.LedgerCheckpoint("l.json", metadata={"lr": float("nan")}), ValueError,
     "metadata must hold finite numbers"),
    ("LedgerCheckpoint object metadata",
     lambda: dpcb.LedgerCheckpoint("l.json", metadata={"opt": object()}), ValueError,
     "metadata must be JSON-serialisable"),
]

def _entry():
    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

    return SampleEntry(SamplingEvent(1000, 0.01), (SumQueryEvent(1.0, 1.0),))


# found by research/reliability/adversarial.py (issue 34, "Done when"): each was accepted
# silently or failed with an error that named neither the argument nor the range
BOUNDS += [
    ("Sampling population 1e30", lambda: tf_dp.engine.Sampling(10**30, 0.01), ValueError,
     "population_size must be an integer >= 1 and <= 2**53"),
    ("num_microbatches 1e30", lambda: sgd(num_microbatches=10**30), ValueError,
     "num_microbatches must be None or an integer in [1, 2**31 - 1], got 'about 1e+30'"),
    ("max_physical_batch_size 1e30", lambda: sgd(max_physical_batch_size=10**30), ValueError,
     "max_physical_batch_size must be None or an integer in [1, 2**31 - 1]"),
    ("truncated poisson q=1e-300",
     lambda: tf_dp.data.truncated_poisson_batches(*xy(), sampling_probability=1e-300),
     ValueError, "sampling_probability=1e-300 gives a default steps_per_epoch"),
    ("record_sampling q=1.5",
     lambda: tf_dp.PrivacyLedger().record_sampling(1000, 1.5, "poisson"), ValueError,
     "selection_probability must be in (0, 1], got 1.5"),
    ("record_sampling n=0", lambda: tf_dp.PrivacyLedger().record_sampling(0, 0.1, "poisson"),
     ValueError, "population_size must be an integer in [1, 2**53], got 0"),
    ("record_sampling n=1e30",
     lambda: tf_dp.PrivacyLedger().record_sampling(10**30, 0.1, "poisson"), ValueError,
     "population_size must be an integer in [1, 2**53], got 1e+30"),
    ("record_sampling n='10'",
     lambda: tf_dp.PrivacyLedger().record_sampling("10", 0.1, "poisson"), TypeError,
     "population_size must be a number or a tensor, got str"),
    ("restore_runs count 1e30",
     lambda: tf_dp.PrivacyLedger().restore_runs([(_entry(), 10**30)]), ValueError,
     "a run's count must be an integer in [1, 1e+15]"),
    ("epsilon_from_rdp text",
     lambda: tf_dp.accounting.epsilon_from_rdp([2.0, 4.0], ["1", 1.0], 1e-5), TypeError,
     "rdp must hold numbers"),
    ("load_tables NaN", lambda: tf_dp.PrivacyLedger().load_tables(
        np.full((2, 8), np.nan), np.zeros((0, 7))), ValueError,
     "the sample table holds a value that is not finite"),
]


def _ledger_file_with_count(tmp_path, count):
    """A correctly re-signed ledger file whose run claims ``count`` steps."""
    path = _ledger_file_with_population(tmp_path, 1000)
    body = json.loads(open(path).read())
    body["runs"][0]["count"] = body["num_samples"] = count
    del body["sha256"]
    import hashlib

    from tf_dp.ledger.ledger_file import _canonical

    body["sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    with open(path, "w") as f:
        json.dump(body, f)
    return path


FILES = [
    # a re-signed count out of range: the error names the file (it named only the count)
    ("ledger count 0 names the file", lambda p: lambda: tf_dp.PrivacyLedger.load(
        _ledger_file_with_count(p, 0)), ValueError, "ledger.json': run count must be"),
    ("ledger count 1e16 names the file", lambda p: lambda: tf_dp.ledger.read_ledger_runs(
        _ledger_file_with_count(p, 10**16)), ValueError, "ledger.json': run count must be"),
    # item 6: a signed ledger file claiming 10**400 records
    ("ledger population 1e400", lambda p: lambda: tf_dp.PrivacyLedger.load(
        _ledger_file_with_population(p, 10**400)), ValueError,
     "population_size must be an integer >= 1 and <= 2**53"),
    # item 4: an audit report that is not UTF-8, or nested too deep to parse
    ("report not utf-8", lambda p: _report_file(p, b'{"kind": "\xff\xfe"}'), ValueError,
     "cannot read it as JSON"),
    ("report nested deep", lambda p: _report_file(p, b"[" * 200_000 + b"]" * 200_000),
     ValueError, "cannot read it as JSON (nested too deep)"),
]


@pytest.mark.parametrize("call,exc,fragment", [row[1:] for row in BOUNDS],
                         ids=[row[0] for row in BOUNDS])
def test_bounds_and_silent_inputs_fail_with_a_clear_error(call, exc, fragment):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(exc) as err:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fragment in str(err.value), str(err.value)
    assert type(err.value) is exc or exc is ValueError and isinstance(err.value, ValueError)
    assert peak < 2**26, peak  # refused before allocating: under 64 MiB traced


@pytest.mark.parametrize("make,exc,fragment", [row[1:] for row in FILES],
                         ids=[row[0] for row in FILES])
def test_bad_files_fail_with_the_documented_error(make, exc, fragment, tmp_path):
    with pytest.raises(exc) as err:
        make(tmp_path)()
    assert fragment in str(err.value), str(err.value)


def test_audit_bound_is_the_memory_of_its_arrays():
    # The range stated for num_canaries: the largest m whose per-step canary code (batch rows x
    # m float32, 4 copies) and traced weights ((steps + 1) x m float64, 3 copies) fit in 4 GiB,
    # counted here directly; the default audit is far inside it.
    from tf_dp.auditing import audit

    n, q, steps = 100, 1.0, 10
    with pytest.raises(ValueError) as err:
        _audit(num_canaries=10**9, sampling_probability=q, steps=steps)()
    largest = int(str(err.value).split("[2, ")[1].split("]")[0])

    def nbytes(m):
        rows = q * (n + m) + 1  # q = 1: the whole population (no padding beyond it)
        return 4 * 4 * rows * m + 3 * 8 * (steps + 1) * m

    assert nbytes(largest) <= 4 * 2**30 < nbytes(largest + 1)
    assert audit.MAX_AUDIT_BYTES == 4 * 2**30
    # accepted counts pass validation and reach the model (here: _never)
    with pytest.raises(AssertionError, match="called although"):
        _audit(num_canaries=1000, sampling_probability=q, steps=steps)()


def test_integers_up_to_the_bounds_are_accepted():
    opt = sgd()
    opt.set_sampling(2**53, 0.01, "poisson")  # the largest population the ledger holds exactly
    assert opt.sampling.population_size == 2**53 and float(2**53) == 2**53
    assert float(2**53 + 1) != 2**53 + 1  # (and the first one float64 cannot hold)
    assert tf_dp.data.poisson.default_max_batch_size(1, 0.5) == 1
    b = tf_dp.data.poisson_batches(*xy(), sampling_probability=1e-300, steps_per_epoch=3, seed=0)
    assert b.steps_per_epoch == 3


def test_ledger_checkpoint_refuses_an_unknown_log_key_after_the_first_step(tmp_path):
    x, y = xy()
    model = dpk.make_private(dense_with())
    model.compile(optimizer=sgd(), loss=MSE)
    steps = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(batch)

    ckpt = dpcb.LedgerCheckpoint(str(tmp_path / "ledger-{nokey}.json"))
    with pytest.raises(ValueError, match=r"names \['nokey'\] but the training logs hold"):
        model.fit(x, y, batch_size=2, epochs=3, verbose=0, callbacks=[Count(), ckpt])
    assert len(steps) == 1  # one step of 8 ran, not a whole epoch
    # a log key that exists is filled in
    ok = dpcb.LedgerCheckpoint(str(tmp_path / "ledger-{epoch}-{loss:.2f}.json"))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[ok])
    assert os.path.basename(ok.last_path).startswith("ledger-1-")
