"""bench/step_time.py's report: absolute times beside the ratio, the machine, per-round ratios.

Checked on synthetic step times against numpy (medians of each round's slice), no timing."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from bench import step_time


def _times():
    rng = np.random.default_rng(0)
    base = list(rng.uniform(4e-3, 6e-3, size=12))
    dp = list(rng.uniform(9e-3, 14e-3, size=12))
    return {"nonprivate": base, "auto": dp}


def test_paired_ratios_are_each_rounds_median_over_nonprivates():
    times = _times()
    got = step_time.paired_ratios(times, steps=4)
    base = np.reshape(times["nonprivate"], (3, 4))
    dp = np.reshape(times["auto"], (3, 4))
    want = np.median(dp, axis=1) / np.median(base, axis=1)
    # two medians and one division per round, each rounded once in float64
    np.testing.assert_allclose(got["auto"], want, rtol=4 * np.finfo(np.float64).eps)
    assert got["nonprivate"] == [1.0, 1.0, 1.0]


def test_spread_is_nearest_rank():
    s = step_time.spread([5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 7.0, 8.0, 6.0, 10.0, 0.0])
    assert s == {"median": 5.0, "p10": 1.0, "p90": 9.0, "min": 0.0, "max": 10.0}


def test_machine_names_the_cpu_and_the_build():
    m = step_time.machine()
    assert set(m) == {"cpu", "cpus", "flags", "load_average", "tensorflow", "keras", "onednn"}
    assert m["cpus"] >= 1 and isinstance(m["flags"], list)
    assert set(m["flags"]) <= set(step_time.KEY_FLAGS)
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            assert m["cpu"] == names[0]


def test_text_report_shows_absolute_times_ratio_spread_and_machine():
    result = {
        "model": "mlp",
        "batch_size": 256,
        "jit_compile": False,
        "strategy": "none",
        "steps_timed": 12,
        "memory_method": "none",
        "machine": step_time.machine(),
        "modes": {},
    }
    times = _times()
    rounds = step_time.paired_ratios(times, 4)
    for mode, t in times.items():
        sp = step_time.spread(t)
        result["modes"][mode] = {
            "ms_per_step": 1e3 * float(np.median(t)),
            "ms_p10_p90": [1e3 * sp["p10"], 1e3 * sp["p90"]],
            "nonprivate_ms": 1e3 * float(np.median(times["nonprivate"])),
            "ratio": float(np.median(t) / np.median(times["nonprivate"])),
            "ratio_by_round": rounds[mode],
            "ratio_round_spread": step_time.spread(rounds[mode]),
            "peak_mem_mb": None,
            "flush_ms": None,
        }
    text = step_time.format_text(result)
    assert result["machine"]["cpu"] in text and "TF " in text
    auto_line = next(ln for ln in text.splitlines() if ln.startswith("auto"))
    assert f"{1e3 * np.median(times['auto']):.2f}" in auto_line
    assert f"{np.median(times['auto']) / np.median(times['nonprivate']):.2f}x" in auto_line
    rs = step_time.spread(rounds["auto"])
    assert f"{rs['p10']:.2f}-{rs['p90']:.2f}x" in auto_line
    assert f"{1e3 * np.median(times['nonprivate']):.2f} ms" in text
