"""pyflakes-level lint (ruff's F rules) over the package, tests, benchmarks, research scripts and
tutorials: undefined names (a NameError waiting for the one input that reaches it), unused imports
and variables, redefinitions. ruff comes with the ``test`` extra."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKED = ("tf_dp", "tests", "bench", "research", "tutorials")


def test_ruff_pyflakes_rules_pass():
    p = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache",
         "--output-format", "concise", *CHECKED],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert "No module named ruff" not in p.stderr, 'ruff is missing: pip install ".[test]"'
    assert p.returncode == 0, p.stdout + p.stderr
