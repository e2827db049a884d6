"""Runs named test scenarios (code snippets sharing one prelude) in one subprocess: one TensorFlow
import for all of them, and a crash (segmentation fault) fails the tests instead of the suite."""

from __future__ import annotations

import json
import os
import sys

from tests.helpers import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_RUNNER = """
import io, json, traceback, contextlib, textwrap
results = {}
for name, body in SCENARIOS.items():
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(textwrap.dedent(body), dict(globals()))
        results[name] = {"ok": True, "out": buf.getvalue()}
    except Exception:
        results[name] = {"ok": False, "out": buf.getvalue() + traceback.format_exc()[-3000:]}
print("RESULTS" + json.dumps(results))
"""


def run_scenarios(prelude: str, scenarios: dict, timeout: float = 600) -> dict:
    """``{name: {"ok": bool, "out": printed text (and the traceback)}}`` of each scenario, run
    after ``prelude`` in one subprocess; fails (AssertionError) if the process dies."""
    code = prelude + "\nSCENARIOS = " + repr(scenarios) + "\n" + _RUNNER
    proc = warm_python.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):])


def scenario_output(results: dict, name: str) -> str:
    """The printed output of scenario ``name``; fails with its traceback if it raised."""
    r = results[name]
    assert r["ok"], r["out"]
    return r["out"]
