"""Every tf_dp module imports alone: each is the first tf_dp module of its process, so an import
circle shows up as an ImportError (``test_imports.py`` finds circles closed by lazy imports too),
and one that uses TensorFlow leaves tf_dp's code excluded from AutoGraph."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

from tests.test_imports import MODULES, ROOT

_ISOLATED = textwrap.dedent(
    """
    import importlib, json, os, sys
    import numpy, scipy, tensorflow, keras  # third-party, loaded once before forking
    assert not [m for m in sys.modules if m == "tf_dp" or m.startswith("tf_dp.")]
    results = {}
    for name in sys.argv[1:]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                importlib.import_module(name)
                from tensorflow.python.autograph.core import config
                excluded = any(getattr(r, "_prefix", None) == "tf_dp" for r in config.CONVERSION_RULES)
                message = "ok" if excluded else "ok, converted by AutoGraph"
            except BaseException as e:
                message = f"{type(e).__name__}: {e}"
            os.write(write, message.encode())
            os._exit(0)
        os.close(write)
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        os.close(read)
        os.waitpid(pid, 0)
        results[name] = b"".join(chunks).decode()
    print(json.dumps(results))
    """
)


def test_every_module_imports_alone_in_a_fresh_interpreter():
    # Each module is the first tf_dp module its process imports (a forked child of a process that
    # loaded only third-party packages), so a circle shows up as an ImportError.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _ISOLATED, *MODULES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(results) == set(MODULES)
    # a module that imports TensorFlow at its top leaves tf_dp excluded from AutoGraph (it imports
    # tf_dp.dp_query or tf_dp.data, which add the rule: tf_dp._compat.exclude_from_autograph)
    uses_tf = {
        m for m, path in MODULES.items()
        if re.search(r"^(import|from) tensorflow\b", path.read_text(), re.MULTILINE)
    }
    assert len(uses_tf) > 40
    failed = {
        m: r for m, r in results.items()
        if not (r == "ok" or (r == "ok, converted by AutoGraph" and m not in uses_tf))
    }
    assert failed == {}
