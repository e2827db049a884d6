"""tf_dp.data.Sampling: the sampling claim's validation, denominator and description."""

import doctest

import pytest

import tf_dp.data.sampling as sampling_module
from tf_dp.data import Sampling


def test_docstring_examples_run():
    result = doctest.testmod(sampling_module)
    assert result.attempted > 0 and result.failed == 0


def test_defaults_and_expected_batch_size():
    s = Sampling(50_000, 0.004)
    assert (s.policy, s.origin, s.unit, s.records_per_unit) == (
        "poisson", "declared", "example", None)
    assert s.expected_batch_size == pytest.approx(200.0)
    assert not s.checked
    assert Sampling(10, 0.5, origin="sampled").checked


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(population_size=0, selection_probability=0.1), "population_size"),
        (dict(population_size=True, selection_probability=0.1), "population_size"),
        (dict(population_size=10.0, selection_probability=0.1), "population_size"),
        (dict(population_size=10, selection_probability=0.0), "selection_probability"),
        (dict(population_size=10, selection_probability=1.5), "selection_probability"),
        (dict(population_size=10, selection_probability=float("nan")), "selection_probability"),
        (dict(population_size=10, selection_probability=0.1, policy="fixed"), "policy"),
        (dict(population_size=10, selection_probability=0.1, origin="trusted"), "origin"),
        (dict(population_size=10, selection_probability=0.1, unit="record"), "unit"),
        (dict(population_size=10, selection_probability=0.1, unit="user"), "records_per_unit"),
        (dict(population_size=10, selection_probability=0.1, unit="user", records_per_unit=0),
         "records_per_unit"),
        (dict(population_size=10, selection_probability=0.1, records_per_unit=3),
         "records_per_unit"),
    ],
)
def test_bad_values_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Sampling(**kwargs)


def test_frozen():
    s = Sampling(10, 0.5)
    with pytest.raises(AttributeError):
        s.population_size = 11


def test_describe_names_unit_and_origin():
    text = Sampling(100, 0.25, policy="shuffle", origin="sampled").describe()
    assert "shuffled fixed-size batches of examples" in text and "sampled by tf_dp" in text
    text = Sampling(100, 0.25, unit="user", records_per_unit=2).describe()
    assert "users" in text and "at most 2 records per user" in text and "not checked" in text
