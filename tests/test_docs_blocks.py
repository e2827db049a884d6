"""Every ```python block of README.md and docs/*.md runs as printed.

Each block runs as a script: a fresh namespace (it must import and define every name it uses), an
empty temporary working directory, a timeout, and a ``DeprecationWarning`` raised by the block's
own code is an error, so the docs use current names. The blocks of one document share one Python
process, one after another, with Keras's global state put back between them
(tests/helpers/run_blocks.py); a block that configures TensorFlow's runtime runs alone, and a
block that kills its process fails alone (the rest run in a new process). Text that is not meant
to run (shell commands, pseudo-code, output) is not marked ``python``.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.helpers import warm_python

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
            cases.append(pytest.param(document, index, line, code, id=f"{document}#{index}"))
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


#: a block that configures TensorFlow's runtime (devices, threads) must run before TensorFlow
#: initialises it, so it gets a process of its own
_OWN_PROCESS = re.compile(r"\btf\.config\.(set_|experimental\.set_)")


def _run_in_one_process(
    blocks: list[dict], workdir: pathlib.Path
) -> tuple[dict, subprocess.CompletedProcess]:
    """Runs ``blocks`` in one process (tests/helpers/run_blocks.py); their results by index."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec, results = workdir / "blocks.json", workdir / "results.jsonl"
    spec.write_text(json.dumps(blocks), encoding="utf-8")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    env.pop("TF_DP_TUTORIAL_SMALL", None)
    try:
        p = warm_python.run(
            [sys.executable, str(ROOT / "tests" / "helpers" / "run_blocks.py"), str(spec),
             str(results), str(workdir)],
            cwd=workdir, env=env, capture_output=True, text=True,
            timeout=TIMEOUT * len(blocks),
        )
    except subprocess.TimeoutExpired as e:
        p = subprocess.CompletedProcess(e.cmd, "timeout", "", f"timed out after {e.timeout} s")
    done = {}
    if results.exists():
        for line in results.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            done[row["index"]] = row
    return done, p


def run_blocks(blocks: list[dict], workdir: str) -> dict:
    """``blocks`` (``{"index", "code"}``) run as printed, in order: ``{index: {"ok", "error",
    "seconds"}}``. The blocks share one interpreter, each in a fresh namespace and working
    directory (see tests/helpers/run_blocks.py), except a block configuring TensorFlow's runtime,
    which runs alone. If the process dies in a block, that block fails with the process's exit
    and the blocks after it run in a new process: one crash fails one block."""
    results, run = {}, 0
    pending = list(blocks)
    while pending:
        if _OWN_PROCESS.search(pending[0]["code"]):
            batch = pending[:1]
        else:
            batch = []
            for block in pending:
                if _OWN_PROCESS.search(block["code"]):
                    break
                batch.append(block)
        run += 1
        done, p = _run_in_one_process(batch, pathlib.Path(workdir) / f"run{run}")
        results.update(done)
        ran = [b for b in batch if b["index"] in done]
        if len(ran) < len(batch):  # the process died (or timed out) in the next block
            dead = batch[len(ran)]
            results[dead["index"]] = {
                "ok": False, "seconds": None,
                "error": f"the process ended in this block (exit {p.returncode}):\n"
                         f"{(p.stderr or '')[-3000:]}",
            }
            ran.append(dead)
        pending = pending[len(ran):]
    return results


@functools.lru_cache(maxsize=None)
def document_results(document: str, workdir: str) -> dict:
    """:func:`run_blocks` over the ```python blocks of ``document`` in ``CASES``."""
    blocks = [{"index": c.values[1], "code": c.values[3]} for c in CASES if c.values[0] == document]
    return run_blocks(blocks, workdir)


@pytest.mark.parametrize("document, index, line, code", CASES)
def test_python_block_runs_as_printed(document, index, line, code, tmp_path_factory):
    workdir = str(tmp_path_factory.getbasetemp() / ("docs_" + re.sub(r"\W", "_", document)))
    result = document_results(document, workdir)[index]
    assert result["ok"], f"{document}:{line}: the block failed:\n{result['error']}"
    assert result["seconds"] <= TIMEOUT, (
        f"{document}:{line}: the block took {result['seconds']} s (limit {TIMEOUT} s)"
    )


def test_each_block_is_judged_alone(tmp_path):
    """The shared interpreter neither leaks names nor lets one failure or crash fail another."""
    blocks = [
        {"index": 1, "code": "x = 1\n"},
        {"index": 2, "code": "print(x)\n"},  # x was block 1's: a NameError here
        {"index": 3, "code": "raise ValueError('no')\n"},
        {"index": 4, "code": "import os\nos._exit(3)\n"},  # kills the process
        {"index": 5, "code": "import warnings\nwarnings.warn('old', DeprecationWarning)\n"},
        {"index": 6, "code": "import os\nassert os.listdir('.') == []\nopen('f', 'w').close()\n"},
        {"index": 7, "code": "import os\nassert os.listdir('.') == []\n"},
    ]
    results = run_blocks(blocks, str(tmp_path))
    verdict = {i: results[i]["ok"] for i in results}
    assert verdict == {1: True, 2: False, 3: False, 4: False, 5: False, 6: True, 7: True}
    assert "NameError" in results[2]["error"] and "ValueError: no" in results[3]["error"]
    assert "exit 3" in results[4]["error"] and "DeprecationWarning" in results[5]["error"]
