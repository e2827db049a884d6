"""Shared by the research scripts: Fashion-MNIST from the machine's IDX files and the tutorials'
reference CNN (Bu et al. 2019). Load it by path (the research folders are scripts, not packages)::

    spec = importlib.util.spec_from_file_location("fashion_mnist", ".../research/fashion_mnist.py")
"""

from __future__ import annotations

import functools
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(train_size=None, test_size=None):
    """``((x, y), (x_test, y_test))``: images ``[n, 28, 28, 1]`` in [0, 1], int32 labels; the
    first ``train_size`` / ``test_size`` examples when given."""
    import numpy as np

    from tf_dp.data import DEBIAN_FASHION_MNIST_DIR, load_fashion_mnist_idx

    (x, y), (xt, yt) = load_fashion_mnist_idx(DEBIAN_FASHION_MNIST_DIR)
    if train_size:
        x, y = x[:train_size], y[:train_size]
    if test_size:
        xt, yt = xt[:test_size], yt[:test_size]
    prep = lambda a: (a.astype(np.float32) / 255.0)[..., None]  # noqa: E731
    return (prep(x), y.astype(np.int32)), (prep(xt), yt.astype(np.int32))


@functools.lru_cache(maxsize=None)
def _tutorial():
    # loaded once: the script defines its absl flags at import
    spec = importlib.util.spec_from_file_location(
        "mnist_dpsgd_tutorial", os.path.join(ROOT, "tutorials", "mnist_dpsgd_tutorial_keras.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tutorial_cnn():
    """A fresh copy of the tutorials' reference CNN (28x28x1 -> 10 logits)."""
    return _tutorial().build_cnn()
