"""Step time of the two JL routes (forward-mode jvp vs double-vjp), side by side with the bench.

Extends ``bench.step_time`` modes with ``jl:R:forward`` and ``jl:R:double_vjp`` (``jl:R`` is the
default ``method="auto"``). Timings interleaved in one process, medians (see ``bench/README.md``).

    python -m research.jl_2020.route_timing --model cnn --modes nonprivate,jl:1:forward,jl:1:double_vjp
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench import step_time
from tf_dp.gradients.jl import JLClipper

_build = step_time.build


def build(model_name: str, mode: str, batch_size: int, seed: int = 0):
    parts = mode.split(":")
    if parts[0] != "jl" or len(parts) < 3:
        return _build(model_name, mode, batch_size, seed)
    model = _build(model_name, ":".join(parts[:2]), batch_size, seed)
    # Select the route (the optimizer resolves its strategy once; pre-set it before any step).
    model.optimizer._strategy = JLClipper(int(parts[1]), method=parts[2])
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument("--modes", default="nonprivate,jl:1:forward,jl:1:double_vjp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    bs = a.batch_size or {"cnn": 256, "mlp": 256, "lstm": 64}[a.model]
    step_time.build = build
    modes = a.modes.split(",")
    times = step_time.time_modes(a.model, bs, modes, a.warmup, a.steps, a.rounds)
    med = {m: statistics.median(t) * 1000 for m, t in times.items()}
    out = {m: {"ms_per_step": round(v, 2), "ratio": round(v / med[modes[0]], 3)} for m, v in med.items()}
    print(json.dumps({"model": a.model, "batch_size": bs, "modes": out}, indent=1))


if __name__ == "__main__":
    main()
