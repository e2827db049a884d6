"""Every ```python block of README.md and docs/*.md runs as printed.

Each block runs alone in its own Python process (a fresh namespace: it must import and define
every name it uses), in an empty temporary working directory, with a timeout. A
``DeprecationWarning`` raised by the block's own code is an error, so the docs use current names.
Text that is not meant to run (shell commands, pseudo-code, output) is not marked ``python``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: the documents whose ```python blocks must run
DOCUMENTS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
#: seconds one block may take (the slowest trains a small model for a few steps)
TIMEOUT = 240
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(document: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each ```python block of ``document`` (a path relative to the repo)."""
    text = (ROOT / document).read_text(encoding="utf-8")
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def _readme_quick_start() -> str:
    """README's quick start trains a CNN on all of MNIST for 15 epochs: tests/test_readme.py runs
    it as printed, with tf_dp's MNIST loader replaced by a small stand-in."""
    from tests.test_readme import _quick_start_code

    return _quick_start_code()


def _cases():
    cases = []
    for document in DOCUMENTS:
        for index, (line, code) in enumerate(python_blocks(document), 1):
            if document == "README.md" and code == _readme_quick_start():
                continue
            cases.append(pytest.param(document, line, code, id=f"{document}#{index}"))
    return cases


CASES = _cases()


def test_the_blocks_are_found():
    # every document with python blocks contributes (README's quick start is run elsewhere)
    found = {case.values[0] for case in CASES}
    assert len(CASES) >= 35, len(CASES)
    assert {
        "docs/keras.md",
        "docs/auditing.md",
        "docs/queries.md",
        "docs/data.md",
        "docs/finetuning.md",
        "docs/ghost.md",
        "docs/accounting.md",
    } <= found
    assert python_blocks("README.md"), "README's quick start"


@pytest.mark.parametrize("document, line, code", CASES)
def test_python_block_runs_as_printed(document, line, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    env.pop("TF_DP_TUTORIAL_SMALL", None)
    try:
        p = subprocess.run(
            [sys.executable, "-W", "error::DeprecationWarning:__main__", str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{document}:{line}: the block did not finish in {TIMEOUT} s")
    assert p.returncode == 0, (
        f"{document}:{line}: the block failed (exit {p.returncode}):\n{p.stderr[-3000:]}"
    )
