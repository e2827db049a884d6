"""Seconds per epoch of non-private, exact and JL(r) training on the reference CNN and BiLSTM.

Runs ``bench.step_time`` (all modes of one model in one process, interleaved, medians after
warm-up; peak memory in a fresh process per mode) and extrapolates ms/step to an epoch of the
paper's datasets: MNIST (N=60000, CNN, B=256) and IMDb (N=25000, BiLSTM, B=64).

    python -m research.jl_2020.speed_table            # runs the bench (several minutes)
    python -m research.jl_2020.speed_table --from cnn.json lstm.json   # format saved results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = "nonprivate,auto,jl:1,jl:4,jl:10"
RUNS = {
    "cnn": {"batch": 256, "n": 60000, "args": ["--steps", "8", "--rounds", "4"]},
    "lstm": {"batch": 64, "n": 25000, "args": ["--steps", "3", "--rounds", "3", "--warmup", "2"]},
}
LABELS = {"nonprivate": "non-private", "auto": "exact (auto: ghost; BiLSTM: ghost+vectorized)"}


def run_bench(model: str) -> dict:
    cfg = RUNS[model]
    cmd = [sys.executable, "-m", "bench.step_time", "--model", model, "--batch_size",
           str(cfg["batch"]), "--modes", MODES, "--format", "json", *cfg["args"]]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(HERE)))
    return json.loads(out.stdout[out.stdout.index("{"):])


def table(results: list[dict]) -> str:
    lines = [
        "| model (batch) | mode | ms/step (median) | ratio to non-private | s/epoch | peak MB (first 3 steps, tracing incl.) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        cfg = RUNS[res["model"]]
        steps = cfg["n"] / cfg["batch"]
        for mode, r in res["modes"].items():
            mem = "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}"
            label = LABELS.get(mode, f"JL({mode.split(':')[1]})" if mode.startswith("jl:") else mode)
            lines.append(
                f"| {res['model']} ({res['batch_size']}) | {label} | {r['ms_per_step']:.1f} | "
                f"{r['ratio']:.2f}x | {r['ms_per_step'] * steps / 1000:.1f} | {mem} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--from", dest="files", nargs="*", default=None)
    a = p.parse_args()
    if a.files:
        results = []
        for f in a.files:
            text = open(f).read()
            results.append(json.loads(text[text.index("{"):]))
    else:
        results = [run_bench(m) for m in RUNS]
    md = table(results)
    print(md)
    with open(os.path.join(HERE, "speed.md"), "w") as f:
        f.write(md + "\n")


if __name__ == "__main__":
    main()
