"""Step time and state memory of correlated noise (banded, BLT) against DP-SGD's independent noise.

``python -m bench.correlated_noise [--model mlp] [--batch_size 256] [--modes dpsgd,banded:4,...]
[--rounds 4] [--steps 10] [--jit_compile] [--format text|json]``

Modes: ``dpsgd`` (``DPKerasSGDOptimizer``, independent noise), ``banded:B`` (a banded strategy of
``B`` bands: ``B - 1`` model-sized noise buffers) and ``blt:D`` (a BLT of ``D`` buffers), both
``tf_dp.keras.DPKerasMFOptimizer``; clip 1, noise multiplier 1.1, learning rate 0.01 and the
library's default gradient mode everywhere. The strategies are fixed, well-conditioned examples
(the step time does not depend on their values). Noise state memory is the buffers' bytes
(``buffers x parameters x 4``), read from the optimizer's state variables.

Protocol (bench/step_time.py's): one process, a model per mode with the same initial weights,
warmed up (tracing excluded); ``--rounds`` interleaved rounds of ``--steps`` timed steps per mode
(``model.train_function`` on one repeated batch), one untimed step after each switch. Reported:
median step time and its 10th-90th percentile spread, and the per-round ratio to ``dpsgd``'s
median of the same round (median and range over rounds), with the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from bench.models import build_model
from bench.step_time import dataset, machine, spread, time_modes

DEFAULT_MODES = ("dpsgd", "banded:2", "banded:4", "banded:8", "blt:2", "blt:4")


class _Banded:
    def __init__(self, bands: int, steps: int = 10_000) -> None:
        row = np.array([1.0] + [0.5 / bands] * (bands - 1))
        self.coef = np.tile(row, (steps, 1))


class _BLT:
    def __init__(self, buffers: int) -> None:
        self.omega = -0.1 * np.ones(buffers)
        self.theta = np.linspace(0.9, 0.1, buffers)


def _optimizer(mode: str):
    import tf_dp.keras as dpk

    common = {"l2_norm_clip": 1.0, "noise_multiplier": 1.1, "learning_rate": 0.01}
    if mode == "dpsgd":
        return dpk.DPKerasSGDOptimizer(**common)
    kind, _, size = mode.partition(":")
    if kind not in ("banded", "blt") or not size.isdigit() or int(size) < 1:
        raise SystemExit(f"--modes: unknown {mode!r}; dpsgd, banded:B or blt:D (B, D >= 1)")
    strategy = _Banded(int(size)) if kind == "banded" else _BLT(int(size))
    return dpk.DPKerasMFOptimizer(strategy=strategy, **common)


def _state_bytes(model: keras.Model) -> int:
    opt = model.optimizer
    if not hasattr(opt, "noise_query") or not opt.engine.state_built:
        return 0
    return sum(
        int(np.prod(b.shape)) * b.dtype.size
        for b in tf.nest.flatten(opt.engine.global_state.buffers)
    )


def run(
    model_name: str, batch_size: int, modes: list[str], rounds: int, steps: int, jit_compile: bool
) -> dict[str, Any]:
    import bench.step_time as st
    import tf_dp.keras as dpk

    def build(name: str, mode: str, b: int, seed: int = 0) -> keras.Model:
        model = dpk.make_private(build_model(name, seed=seed))
        model.compile(
            optimizer=_optimizer(mode),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        # one repeated batch: declare the sampling of a 60000-example shuffled epoch (bench/
        # step_time.py's declaration; it affects the ledger only, not the time)
        model.optimizer.set_sampling(60000, b / 60000, "shuffle")
        return model

    built: dict[str, keras.Model] = {}

    def build_and_keep(name, mode, b, seed=0):
        built[mode] = build(name, mode, b, seed)
        return built[mode]

    st.build = build_and_keep  # time_modes builds through bench.step_time.build
    dataset(model_name, batch_size)
    times = time_modes(model_name, batch_size, modes, warmup=3, steps=steps, rounds=rounds)
    params = int(sum(np.prod(v.shape) for v in built[modes[0]].trainable_variables))
    base = "dpsgd" if "dpsgd" in modes else modes[0]
    ratios = {
        m: [
            statistics.median(t[r * steps : (r + 1) * steps])
            / statistics.median(times[base][r * steps : (r + 1) * steps])
            for r in range(rounds)
        ]
        for m, t in times.items()
    }
    return {
        "model": model_name,
        "batch_size": batch_size,
        "jit_compile": jit_compile,
        "rounds": rounds,
        "steps": steps,
        "parameters": params,
        "machine": machine(),
        "modes": {
            m: {
                "ms": {k: v * 1e3 for k, v in spread(times[m]).items()},
                "ratio_to_dpsgd": {
                    "median": statistics.median(ratios[m]),
                    "min": min(ratios[m]),
                    "max": max(ratios[m]),
                },
                "state_mb": _state_bytes(built[m]) / 2**20,
            }
            for m in modes
        },
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--jit_compile", action="store_true")
    p.add_argument("--format", choices=("text", "json"), default="text")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.steps < 1 or a.batch_size < 1:
        raise SystemExit("need --rounds, --steps and --batch_size >= 1")
    out = run(a.model, a.batch_size, a.modes.split(","), a.rounds, a.steps, a.jit_compile)
    if a.format == "json":
        print(json.dumps(out, indent=2))
        return 0
    m = out["machine"]
    print(
        f"{a.model} ({out['parameters']} parameters), batch {a.batch_size}, "
        f"jit_compile={a.jit_compile}, {a.rounds} rounds x {a.steps} steps; {m['cpu']} "
        f"({m['cpus']} CPUs), load {m['load_average']}"
    )
    print(f"{'mode':<12}{'ms/step':>9}{'p10-p90':>16}{'vs dpsgd':>10}{'range':>14}{'state MB':>10}")
    for mode, r in out["modes"].items():
        ms, ra = r["ms"], r["ratio_to_dpsgd"]
        print(
            f"{mode:<12}{ms['median']:>9.2f}{ms['p10']:>8.2f}-{ms['p90']:<7.2f}"
            f"{ra['median']:>9.3f}x{ra['min']:>7.3f}-{ra['max']:<6.3f}{r['state_mb']:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
