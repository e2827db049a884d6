"""Step time of DP training by batch selection: fixed (shuffled) batches, padded Poisson,
truncated Poisson and balls-in-bins, through ``model.fit`` on the selections' own datasets.

``python -m bench.batch_selection [--model mlp] [--n 6000] [--batch_size 256] [--rounds 3]
[--steps S] [--selections fixed,poisson,...] [--jit_compile] [--format text|json]``

Small batches (the padding question): ``python -m bench.batch_selection --n 60000
--batch_size 8 --steps 300 --selections fixed,poisson_max,poisson``.

Every selection feeds the same private model (``DPKerasSGDOptimizer``, clip 1, noise 1.1, the
library's default gradient mode) with ``n`` synthetic examples of the model's input shape at an
expected batch size ``b``. What differs is what a step computes on: ``b`` rows (fixed batches),
the Poisson sample padded to the smallest of ``poisson_batches``' ``pad_sizes="auto"`` that holds
it (``poisson``: the median, 0.9, 0.999 and ``1 - 1e-6`` quantiles of ``Binomial(n, b / n)``), or
always to the ``1 - 1e-6`` quantile (``poisson_max``: ``pad_sizes=None``; balls-in-bins at
``Binomial(n, 1 / T)``), or exactly ``B`` rows (truncated Poisson, ``B`` at the same quantile).
Padding rows cost the same as real ones, so the row count drives the time. ``--steps`` times
that many steps per epoch (default one expected pass).

Protocol: one process; each selection gets a model with the same initial weights, compiled and
warmed up with one ``fit`` epoch (tracing excluded); then ``--rounds`` interleaved rounds, each
running one timed ``fit`` epoch of every selection. Reported per selection: rows per step, the
median time per step (epoch wall time / steps) and the ratio to fixed batches, with the machine
(``bench.step_time.machine``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import keras
import numpy as np

from bench.models import build_model, make_batch
from bench.step_time import machine

SELECTIONS = ("fixed", "poisson", "truncated_poisson", "balls_in_bins")
ALL_SELECTIONS = SELECTIONS + ("poisson_max",)


def _data(model_name: str, n: int):
    x, y = make_batch(model_name, n)
    return np.asarray(x), np.asarray(y)


def _batches(selection: str, x, y, batch_size: int, steps=None):
    """``(fit input, fit kwargs, rows per step, steps per epoch)`` of one selection; rows per
    step is the expected padded size (over the pad sizes' Binomial probabilities) for
    ``poisson``."""
    import tf_dp

    n = len(y)
    q = batch_size / n
    if selection == "fixed":
        total = -(-n // batch_size)
        kwargs = {"batch_size": batch_size, "shuffle": True}
        if steps is not None and steps < total:
            kwargs["steps_per_epoch"] = total = steps
        return (x, y), kwargs, batch_size, total
    if selection in ("poisson", "poisson_max"):
        b = tf_dp.data.poisson_batches(x, y, sampling_probability=q, steps_per_epoch=steps,
                                       pad_sizes="auto" if selection == "poisson" else None)
        return (b,), {}, _expected_padded_rows(n, q, b.pad_sizes), b.steps_per_epoch
    elif selection == "truncated_poisson":
        b = tf_dp.data.truncated_poisson_batches(x, y, sampling_probability=q,
                                                 steps_per_epoch=steps)
    elif selection == "balls_in_bins":
        b = tf_dp.data.balls_in_bins_batches(x, y, batch_size=batch_size)
    else:
        raise SystemExit(f"--selections: unknown {selection!r}; one of {ALL_SELECTIONS}")
    return (b,), {}, b.max_batch_size, b.steps_per_epoch


def _expected_padded_rows(n: int, q: float, sizes) -> float:
    """``E[rows]`` of a Poisson sample padded to the smallest of ``sizes`` that holds it (a
    larger sample emitted whole), from the Binomial(n, q) probabilities."""
    from scipy import stats

    k = np.arange(n + 1)
    pmf = stats.binom.pmf(k, n, q)
    sizes = np.asarray(sizes)
    i = np.searchsorted(sizes, k)
    rows = np.where(i < len(sizes), sizes[np.minimum(i, len(sizes) - 1)], k)
    return float(np.sum(pmf * rows))


def _model(model_name: str, jit_compile: bool) -> keras.Model:
    import tf_dp.keras as dpk

    model = dpk.make_private(build_model(model_name, seed=0))
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                          learning_rate=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def run(model_name: str, n: int, batch_size: int, rounds: int, jit_compile: bool,
        selections=SELECTIONS, steps=None) -> dict:
    x, y = _data(model_name, n)
    setups = {}
    for s in selections:
        args, kwargs, rows, steps_ = _batches(s, x, y, batch_size, steps)
        model = _model(model_name, jit_compile)
        model.fit(*args, epochs=1, verbose=0, **kwargs)  # warm-up: tracing excluded
        setups[s] = (model, args, kwargs, rows, steps_)
    times = {s: [] for s in selections}
    for _ in range(rounds):
        for s in selections:
            model, args, kwargs, rows, steps = setups[s]
            t0 = time.perf_counter()
            model.fit(*args, epochs=1, verbose=0, **kwargs)
            times[s].append((time.perf_counter() - t0) / steps * 1e3)
    base = statistics.median(times[selections[0]])
    return {
        "model": model_name, "n": n, "batch_size": batch_size, "jit_compile": jit_compile,
        "rounds": rounds, "machine": machine(),
        "selections": {
            s: {"rows": setups[s][3], "steps_per_epoch": setups[s][4],
                "ms_per_step": statistics.median(times[s]), "all_ms": times[s],
                "ratio_to_fixed": statistics.median(times[s]) / base}
            for s in selections
        },
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp")
    p.add_argument("--n", type=int, default=6000)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None,
                   help="steps per timed epoch (default: one expected pass)")
    p.add_argument("--jit_compile", action="store_true")
    p.add_argument("--selections", default=",".join(SELECTIONS))
    p.add_argument("--format", choices=("text", "json"), default="text")
    a = p.parse_args(argv)
    if a.n < a.batch_size or a.batch_size < 1 or a.rounds < 1:
        raise SystemExit("need 1 <= --batch_size <= --n and --rounds >= 1")
    if a.steps is not None and a.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {a.steps}")
    out = run(a.model, a.n, a.batch_size, a.rounds, a.jit_compile,
              tuple(a.selections.split(",")), a.steps)
    if a.format == "json":
        print(json.dumps(out, indent=2))
        return 0
    m = out["machine"]
    print(f"{a.model}, n={a.n}, b={a.batch_size}, jit_compile={a.jit_compile}, {a.rounds} rounds; "
          f"{m['cpu']} ({m['cpus']} CPUs), load {m['load_average']}")
    print(f"{'selection':<20}{'rows':>6}{'ms/step':>10}{'vs fixed':>10}")
    for s, r in out["selections"].items():
        print(f"{s:<20}{r['rows']:>6.4g}{r['ms_per_step']:>10.2f}{r['ratio_to_fixed']:>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
