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
