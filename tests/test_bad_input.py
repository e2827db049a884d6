"""Adversarial inputs: crafted ledger files, extreme numbers, bad CLI flags.

Every input here must be refused with a clear error (a ``LedgerFileError`` / ``ValueError`` naming
the problem, or exit status 2 with one line on stderr) or analysed correctly; none may end in a
traceback, a crash or an allocation proportional to a step count written in the file.
"""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tf_dp import accounting as acc
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.ledger_file import (
    LedgerFileError,
    read_ledger_file,
    read_ledger_runs,
    write_ledger_file,
)
from tests.helpers import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checksummed(payload):
    """Adds the checksum the way an adversary would: sha256 of the canonical JSON."""
    body = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return dict(payload, sha256=hashlib.sha256(body).hexdigest())


def _ledger(count=1, sens=1.0, std=1.0, n=1000, q=0.01, num_samples=None):
    query = {"l2_sensitivity": sens, "noise_stddev": std, "mechanism": "gaussian",
             "jl_projections": None}
    return _checksummed({
        "format": "tf_dp.privacy_ledger", "version": 1,
        "num_samples": count if num_samples is None else num_samples,
        "runs": [{"count": count, "queries": [query],
                  "sampling": {"population_size": n, "selection_probability": q,
                               "policy": "poisson"}}],
        "metadata": {},
    })


# name -> file text. Each must be refused by read_ledger_file with LedgerFileError.
BAD_FILES = {
    "deeply_nested": "[" * 100_000 + "]" * 100_000,
    "deeply_nested_object": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "integer_of_100k_digits": '{"format": "tf_dp.privacy_ledger", "version": 1, "num_samples": '
    + "9" * 100_000 + "}",
    "noise_stddev_1e-300": json.dumps(_ledger(std=1e-300)),
    "l2_sensitivity_1e300": json.dumps(_ledger(sens=1e300)),
    "noise_stddev_subnormal": json.dumps(_ledger(std=5e-324)),
    "count_1e20": json.dumps(_ledger(count=10**20)),
    "count_4000_digits": json.dumps(_ledger(count=10**3999)),
    "count_zero": json.dumps(_ledger(count=0)),
    "count_float": json.dumps(_ledger(count=1e9)),
    "count_true": json.dumps(_ledger(count=True)),
    "num_samples_mismatch": json.dumps(_ledger(count=5, num_samples=6)),
    "sampling_probability_1e300": json.dumps(_ledger(q=1e300)),
    "population_1e300": json.dumps(_ledger(n=1e300)),
    # expands to 10^9 entries: read_ledger_file (one entry per step) refuses it
    "count_1e9_listed": json.dumps(_ledger(count=10**9)),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_read_ledger_file_refuses_with_ledger_file_error(tmp_path, name):
    path = tmp_path / f"{name}.json"
    path.write_text(BAD_FILES[name])
    with pytest.raises(LedgerFileError) as info:
        read_ledger_file(path)
    assert len(str(info.value).splitlines()) == 1


# CLI arguments (besides --delta) -> text the one-line error must contain.
BAD_CLI = [
    (["--N=1000", "--batch_size=10", "--steps=10", "--noise_multiplier=1e-300"],
     "--noise_multiplier must be 0"),
    (["--N=1000", "--batch_size=10", "--steps=10", "--noise_multiplier=nan"],
     "--noise_multiplier must be 0"),
    (["--ledger={noise_stddev_1e-300}"], "noise_stddev"),
    (["--ledger={l2_sensitivity_1e300}"], "l2_sensitivity"),
    (["--ledger={deeply_nested}"], "nested too deeply"),
    (["--ledger={integer_of_100k_digits}"], "not valid JSON"),
    (["--ledger={count_1e20}"], "run count"),
]


@pytest.mark.parametrize("args, message", BAD_CLI)
def test_cli_refuses_with_status_2_and_one_line(tmp_path, args, message):
    for name in ("noise_stddev_1e-300", "l2_sensitivity_1e300", "deeply_nested",
                 "integer_of_100k_digits", "count_1e20"):
        (tmp_path / f"{name}.json").write_text(BAD_FILES[name])
    args = [a.format(**{n: tmp_path / f"{n}.json" for n in BAD_FILES}) for a in args]
    p = subprocess.run(
        [sys.executable, "-m", "tf_dp.cli.compute_dp_sgd_privacy", *args, "--delta=1e-5"],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    assert message in p.stderr


def test_billion_step_ledger_is_analysed_without_expanding(tmp_path):
    """A 400-byte file claiming 10^9 steps is read as one run and analysed under a 1 GB address
    space limit (expanding it would take 8 GB); epsilon matches dp_accounting's RDP accountant."""
    path = tmp_path / "big.json"
    path.write_text(json.dumps(_ledger(count=10**9, n=10**7, q=1e-5, std=5.0)))
    assert path.stat().st_size < 500
    script = textwrap.dedent(f"""
        import resource, sys, tracemalloc
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from tf_dp.ledger.ledger_file import read_ledger_runs
        from tf_dp.accounting import compute_epsilon
        tracemalloc.start()  # after the imports: what the reader and the accountant allocate
        runs = read_ledger_runs({str(path)!r})
        r = compute_epsilon({str(path)!r}, 1e-5, "rdp")
        peak = tracemalloc.get_traced_memory()[1]
        print(len(runs), runs[0][1], r.steps, repr(r.epsilon), peak, "tensorflow" in sys.modules)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    n_runs, count, steps, eps, peak, has_tf = p.stdout.split()
    assert (int(n_runs), int(count), int(steps)) == (1, 10**9, 10**9)
    assert int(peak) < 50 * 2**20  # per step it would be gigabytes
    assert has_tf == "False"
    from dp_accounting import dp_event, rdp

    oracle = rdp.RdpAccountant()
    oracle.compose(dp_event.PoissonSampledDpEvent(1e-5, dp_event.GaussianDpEvent(5.0)), 10**9)
    assert float(eps) == pytest.approx(oracle.get_epsilon(1e-5), rel=1e-6)


def test_runs_and_entries_give_the_same_epsilon(tmp_path):
    """A file read as runs and the same steps listed one by one: identical statements."""
    a = SampleEntry(SamplingEvent(1000, 0.01), (SumQueryEvent(1.0, 1.0),))
    b = SampleEntry(SamplingEvent(1000, 0.02), (SumQueryEvent(1.0, 2.0),))
    entries = [a] * 30 + [b] * 7 + [a] * 5
    path = tmp_path / "l.json"
    write_ledger_file(path, entries)
    assert read_ledger_runs(path) == [(a, 30), (b, 7), (a, 5)]
    for accountant in acc.ACCOUNTANTS:
        from_file = acc.compute_epsilon(path, 1e-5, accountant)
        listed = acc.compute_epsilon(entries, 1e-5, accountant)
        assert from_file == listed and from_file.steps == 42
    assert acc.compute_delta(read_ledger_runs(path), 2.0) == acc.compute_delta(entries, 2.0)


@pytest.mark.parametrize("std", [1e-140, 1e-40, 1e-8])
@pytest.mark.parametrize("accountant", acc.ACCOUNTANTS)
def test_tiny_noise_gives_a_number_not_a_crash(std, accountant):
    """Noise far below the sensitivity (but within the recordable range) with q = 1: every
    accountant answers (epsilon is huge or infinite, both valid upper bounds) instead of raising
    OverflowError. Closed form: q = 1 is a plain Gaussian mechanism, mu = 1/std."""
    e = SampleEntry(SamplingEvent(1000, 1.0), (SumQueryEvent(1.0, std),))
    r = acc.compute_epsilon([e] * 3, 1e-5, accountant)
    # A Gaussian mechanism with mu >= 1e8 has epsilon > mu^2/2 - mu * 5 at delta = 1e-5
    # (Balle & Wang 2018), far above 1e10.
    assert r.epsilon > 1e10


def test_shuffled_batch_of_less_than_one_record_is_refused():
    e = SampleEntry(SamplingEvent(1000, 1e-300, "shuffle"), (SumQueryEvent(1.0, 1.0),))
    with pytest.raises(ValueError, match="must be >= 1"):
        acc.compute_epsilon([e], 1e-5)


def test_hyperparameter_noise_multiplier_range_is_named():
    with pytest.raises(ValueError, match="noise_multiplier must be 0"):
        acc.dp_sgd_epsilon(1000, 10, 1e-300, 1e-5, steps=10)
    with pytest.raises(ValueError, match="l2_sensitivity / noise_stddev must be <="):
        SumQueryEvent(1e300, 1.0)


@pytest.mark.parametrize("replicas, mode", [(2, "vectorized"), (3, "ghost")])
def test_mirrored_strategy_trains_on_every_poisson_batch_size(replicas, mode):
    """Padded Poisson batches of 5, 6, 7 and 9 rows (q * n = 4) on 2 and 3
    replicas: every step runs, records one ledger entry and moves the weights by a finite
    amount."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    p = warm_python.run(
        [sys.executable, os.path.join(ROOT, "tests", "helpers", "mirrored_any_batch_size.py"),
         str(replicas), mode],
        capture_output=True, text=True, timeout=600, env=env,
    )
    lines = [line for line in p.stdout.splitlines() if line.startswith("REPORT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    changes = json.loads(lines[-1][len("REPORT "):])
    assert sorted(int(k) for k in changes) == [5, 6, 7, 9]
    # noise 0, learning rate 0.5, clip 1: a step moves a weight by at most 0.5 * 1 / 8 * ... > 0
    assert all(0 < c < 1 for c in changes.values()), changes


@pytest.mark.parametrize("kwargs, name", [
    (dict(l2_norm_clip=1e39, noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=1e20, noise_multiplier=1e20), "noise_multiplier * l2_norm_clip"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1e-50), "noise_multiplier"),
    (dict(l2_norm_clip=1e-50, noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=1.0, noise_stddev=1e39), "noise_stddev"),
])
def test_optimizer_refuses_values_float32_cannot_hold(kwargs, name):
    """float32 (the step's dtype) holds (0 or) [1.1755e-38, 3.4028e38]: values outside, or a
    clip * noise multiplier product outside, are refused at construction, naming the argument."""
    from tf_dp.keras import DPKerasSGDOptimizer

    with pytest.raises(ValueError, match="float32") as info:
        DPKerasSGDOptimizer(learning_rate=0.1, **kwargs)
    assert str(info.value).startswith(name)


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_non_finite_clip_at_run_time_records_and_applies_nothing(mode, tmp_path):
    """A ``tf.Variable`` clip set to inf between fits: the fit fails with a ValueError naming the
    clip, the weights and the ledger are as they were, and the ledger stays readable/savable."""
    import keras

    import tf_dp
    from tf_dp.accounting import compute_epsilon

    x = np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    clip = tf.Variable(1.0)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    optimizer = tf_dp.keras.DPKerasSGDOptimizer(
        dp_sum_query=tf_dp.dp_query.GaussianSumQuery(clip, 1.0), learning_rate=0.1)
    model.compile(optimizer=optimizer, run_eagerly=mode == "eager", jit_compile=mode == "xla",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=5, epochs=1, verbose=0)
    before = optimizer.ledger.samples()
    weights = [v.numpy().copy() for v in model.trainable_variables]
    clip.assign(float("inf"))
    with pytest.raises(ValueError, match="clip"):
        model.fit(x, y, batch_size=5, epochs=1, verbose=0)
    assert optimizer.ledger.samples() == before
    for w, v in zip(weights, model.trainable_variables):
        np.testing.assert_array_equal(w, v.numpy())
    optimizer.ledger.save(tmp_path / "l.json")
    assert compute_epsilon(tmp_path / "l.json", 1e-5).epsilon == pytest.approx(
        compute_epsilon(before, 1e-5).epsilon)
