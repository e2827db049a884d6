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
    """The snippet runs in an empty namespace: it loads its own data (through tf_dp's loader,
    replaced here by a small stand-in with the loader's return format) and defines every name it
    uses."""
    import tf_dp.data

    code = _quick_start_code()
    assert "make_private" in code and "ledger.save" in code
    rng = np.random.default_rng(0)
    n = 4096  # q = 256 / n = 1/16, as small as the snippet allows while the budget lasts
    y_train = rng.integers(0, 10, n).astype(np.uint8)
    x_train = rng.integers(0, 26, size=(n, 28, 28)).astype(np.uint8)
    x_train[np.arange(n), y_train, y_train] = 255  # learnable signal
    test = (x_train[:100], y_train[:100])
    calls = []

    def loader(*args, **kwargs):
        calls.append((args, kwargs))
        return (x_train, y_train), test, "fashion_mnist"

    monkeypatch.setattr(tf_dp.data, "load_mnist_or_fashion_mnist", loader)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 -- the README's own code
    assert len(calls) == 1
    x = namespace["x_train"]
    assert x.shape == (n, 28, 28, 1) and x.dtype == np.float32 and 0.0 <= x.min() <= x.max() <= 1
    model = namespace["model"]
    entries = model.optimizer.ledger.samples()
    assert entries and all(e.sampling.policy == "poisson" for e in entries)
    assert entries[0].sampling.population_size == n
    assert os.path.exists(tmp_path / "ledger.json")
