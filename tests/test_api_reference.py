"""The API reference builds (docs/build_api.py, pdoc) and documents every public name."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _build_api():
    spec = importlib.util.spec_from_file_location("build_api", ROOT / "docs" / "build_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_documents_every_public_name(tmp_path):
    build_api = _build_api()
    files = build_api.build(tmp_path)
    assert (tmp_path / "index.html").exists()
    for name in build_api.MODULES:
        page = tmp_path.joinpath(*name.split(".")).with_suffix(".html")
        assert page in files, f"no page for {name}"
        html = page.read_text()
        # each public name has its own entry (anchor), or, for a submodule, a link to its page
        missing = [
            n
            for n in importlib.import_module(name).__all__
            if f'id="{n}"' not in html and not re.search(rf'href="[^"]*/{n}\.html"', html)
        ]
        assert missing == [], f"{name}: {missing}"
    assert "GaussianSumQuery" in (tmp_path / "tf_dp.html").read_text()


def test_dp_optimizer_attributes_are_in_the_reference(tmp_path):
    """What the docs tell users to read on a DP optimizer (``optimizer.gradient_clipper``, its
    ledger, its noise...) is documented: the optimizer's bases have their pages, and each
    public attribute its entry."""
    import inspect

    from tf_dp.keras.optimizers import DPOptimizerMixin

    build_api = _build_api()
    build_api.build(tmp_path)
    pages = "".join(p.read_text() for p in tmp_path.rglob("*.html"))
    public = sorted(
        name
        for base in inspect.getmro(DPOptimizerMixin)
        if base.__module__.startswith("tf_dp.")
        for name in vars(base)
        if not name.startswith("_")
    )
    for name in ("gradient_clipper", "ledger", "noise_multiplier", "set_sampling",
                 "for_target_epsilon"):
        assert name in public
    missing = [n for n in public if not re.search(rf'id="\w+\.{n}"', pages)]
    assert missing == [], missing
