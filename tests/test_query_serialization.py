"""Optimizers built from dp_sum_query are saved in .keras files: query configs round-trip, an
adaptive query's reached clip is restored, unsupported queries are refused by name."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.dp_query import deserialize_query, serialize_query

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _adaptive(clip=0.05):
    return tf_dp.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=clip, noise_multiplier=1.2, target_unclipped_quantile=0.3,
        learning_rate=0.15, clipped_count_stddev=2.5, expected_num_records=40,
        geometric_update=False)


QUERIES = {
    "gaussian": lambda: tf_dp.GaussianSumQuery(1.5, 2.0),
    "automatic": lambda: tf_dp.AutomaticClipSumQuery(1.0, 1.1, gamma=0.05),
    "adaptive": _adaptive,
    "adaptive_average": lambda: tf_dp.QuantileAdaptiveClipAverageQuery(
        0.2, 1.1, 0.5, 0.2, 3.0, 60),
    "normalized": lambda: tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(1.0, 1.0), 32.0),
    "nested": lambda: tf_dp.NestedQuery(
        {"a": [tf_dp.GaussianSumQuery(1.0, 1.0), tf_dp.AutomaticClipSumQuery(0.5, 0.7)],
         "b": (tf_dp.GaussianSumQuery(0.1, 0.2),)}),
}


def _describe(query):
    """Every query's class and public values, independently of get_config."""
    if isinstance(query, tf_dp.NestedQuery):
        return ("NestedQuery", tf.nest.map_structure(_describe, query.queries))
    if isinstance(query, tf_dp.QuantileAdaptiveClipAverageQuery):
        return ("avg", _describe(query.numerator_query))
    if isinstance(query, tf_dp.NormalizedQuery):
        return ("norm", _describe(query.numerator_query),
                float(query.initial_global_state().denominator))
    gs = query.initial_global_state()
    values = [float(np.asarray(v)) for v in tf.nest.flatten(gs)
              if np.asarray(v).dtype.kind in "fiu" or hasattr(v, "numpy")]
    return (type(query).__name__, values)


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_query_config_round_trips_through_json(name):
    query = QUERIES[name]()
    config = json.loads(json.dumps(serialize_query(query)))
    rebuilt = deserialize_query(config)
    assert type(rebuilt) is type(query)
    assert _describe(rebuilt) == _describe(query)
    assert serialize_query(rebuilt) == config


def test_adaptive_config_has_the_current_clip():
    query = _adaptive(0.05)
    query.l2_norm_clip.assign(0.8125)
    assert serialize_query(query)["config"]["initial_l2_norm_clip"] == 0.8125
    assert float(deserialize_query(serialize_query(query)).l2_norm_clip.numpy()) == 0.8125


def test_unsupported_queries_are_refused_by_name():
    joint = tf_dp.JointClipGaussianSumQuery(1.0, 1.0, scales=[1.0, 0.1])
    with pytest.raises(NotImplementedError, match="JointClipGaussianSumQuery cannot be serialised"):
        serialize_query(joint)
    with pytest.raises(NotImplementedError, match="JointClipGaussianSumQuery"):
        serialize_query(tf_dp.NestedQuery([tf_dp.GaussianSumQuery(1.0, 1.0), joint]))
    var_clip = tf_dp.GaussianSumQuery(tf.Variable(1.0), 1.0)
    with pytest.raises(NotImplementedError, match="l2_norm_clip of type"):
        serialize_query(var_clip)
    with pytest.raises(ValueError, match="class_name must be one of"):
        deserialize_query({"class_name": "Nope", "config": {}})
    with pytest.raises(ValueError, match="config must be a dict"):
        deserialize_query({"config": {}})
    opt = tf_dp.keras.DPKerasSGDOptimizer(dp_sum_query=joint, learning_rate=0.1)
    with pytest.raises(NotImplementedError, match="JointClipGaussianSumQuery"):
        opt.get_config()


def test_adaptive_model_saved_and_reloaded_resumes_its_clip_and_ledger(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    keras.utils.set_random_seed(0)
    query = _adaptive(0.05)
    model = tf_dp.keras.DPSequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=tf_dp.keras.DPKerasAdamOptimizer(dp_sum_query=query,
                                                             learning_rate=0.01), loss=LOSS)
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=0.2, seed=3)
    model.fit(batches, epochs=1, verbose=0)
    reached = float(query.l2_norm_clip.numpy())
    assert reached != pytest.approx(0.05)
    recorded = model.optimizer.ledger.samples()
    path = str(tmp_path / "adaptive.keras")
    model.save(path)

    loaded = keras.models.load_model(path)  # a DPSequential compiled with its DP optimizer
    lq = loaded.optimizer.dp_query.query
    assert isinstance(lq, tf_dp.QuantileAdaptiveClipSumQuery)
    assert float(lq.l2_norm_clip.numpy()) == pytest.approx(reached, rel=1e-6)
    cfg = serialize_query(lq)["config"]
    assert {k: cfg[k] for k in ("noise_multiplier", "target_unclipped_quantile", "learning_rate",
                                "clipped_count_stddev", "expected_num_records",
                                "geometric_update")} == {
        "noise_multiplier": 1.2, "target_unclipped_quantile": 0.3, "learning_rate": 0.15,
        "clipped_count_stddev": 2.5, "expected_num_records": 40.0, "geometric_update": False}
    assert loaded.optimizer.ledger.samples() == recorded
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # training on: the first new step runs with the reached clip, and the ledger continues
    loaded.fit(batches, epochs=1, verbose=0)
    entries = loaded.optimizer.ledger.samples()
    assert entries[: len(recorded)] == recorded
    new = entries[len(recorded)]
    assert new.queries[0].l2_sensitivity == pytest.approx(reached, rel=1e-6)
    assert new.queries[1].noise_stddev == pytest.approx(2.5)


class _ScaledSumQuery(tf_dp.dp_query.SumAggregationDPQuery):
    """A user query outside tf_dp: clips to ``clip`` and adds noise of stddev ``clip * z``."""

    def __init__(self, clip, z):
        self.clip, self.z = clip, z

    def get_config(self):
        return {"clip": self.clip, "z": self.z}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def initial_global_state(self):
        return ()

    def derive_sample_params(self, global_state):
        return ()

    def initial_sample_state(self, template=None):
        return tf.zeros([])

    def preprocess_record(self, params, record):
        return record

    def get_noised_result(self, sample_state, global_state):
        return sample_state, global_state

    def sum_query_specs(self, global_state):
        return [tf_dp.dp_query.SumQuerySpec(self.clip, self.clip * self.z)]


def test_a_user_query_class_decorated_outside_tf_dp_round_trips():
    user_cls = tf_dp.dp_query.serializable_query(
        type("UserScaledSumQuery", (_ScaledSumQuery,), {"__module__": __name__}))
    config = json.loads(json.dumps(serialize_query(user_cls(0.75, 1.3))))
    assert config == {"class_name": "UserScaledSumQuery", "config": {"clip": 0.75, "z": 1.3}}
    rebuilt = deserialize_query(config)
    assert type(rebuilt) is user_cls and (rebuilt.clip, rebuilt.z) == (0.75, 1.3)
    # inside a NestedQuery too (the structure's leaves go through the same registry)
    nested = tf_dp.NestedQuery({"user": user_cls(0.5, 2.0), "g": tf_dp.GaussianSumQuery(1.0, 1.0)})
    again = deserialize_query(json.loads(json.dumps(serialize_query(nested))))
    assert type(again.queries["user"]) is user_cls and again.queries["user"].clip == 0.5


def test_an_undecorated_user_query_is_refused_naming_the_decorator():
    with pytest.raises(NotImplementedError, match=r"_ScaledSumQuery cannot be serialised: decorate "
                       r"the class with @tf_dp\.dp_query\.serializable_query"):
        serialize_query(_ScaledSumQuery(1.0, 1.0))
    # a subclass of a decorated built-in is not serialised under its parent's name
    sub = type("GaussianSubclass", (tf_dp.GaussianSumQuery,), {})
    with pytest.raises(NotImplementedError, match="GaussianSubclass cannot be serialised"):
        serialize_query(sub(1.0, 1.0))
    with pytest.raises(ValueError, match="serializable_query"):
        deserialize_query({"class_name": "NeverRegisteredQuery", "config": {}})


def test_two_classes_cannot_share_a_serialised_name():
    other = type("GaussianSumQuery", (_ScaledSumQuery,), {"__module__": "somewhere_else"})
    with pytest.raises(ValueError, match="'GaussianSumQuery' is already registered"):
        tf_dp.dp_query.serializable_query(other)
    with pytest.raises(TypeError, match="DPQuery subclasses"):
        tf_dp.dp_query.serializable_query(int)
