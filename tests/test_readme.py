"""README's quick start runs as written (on a small stand-in for MNIST) and ends in a statement."""

import os
import re

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quick_start_code() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quick_start_runs(tmp_path, monkeypatch):
    code = _quick_start_code()
    assert "make_private" in code and "ledger.save" in code
    rng = np.random.default_rng(0)
    n = 4096  # q = 256 / n = 1/16, as small as the snippet allows while the budget lasts
    y_train = rng.integers(0, 10, n).astype(np.int32)
    x_train = rng.normal(size=(n, 28, 28, 1)).astype(np.float32) * 0.1
    x_train[np.arange(n), y_train, y_train, 0] += 3.0  # learnable signal
    monkeypatch.chdir(tmp_path)
    namespace = {"x_train": x_train, "y_train": y_train}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 -- the README's own code
    model = namespace["model"]
    entries = model.optimizer.ledger.samples()
    assert entries and all(e.sampling.policy == "poisson" for e in entries)
    assert entries[0].sampling.population_size == n
    assert os.path.exists(tmp_path / "ledger.json")
