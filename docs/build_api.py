"""Builds tf_dp's API reference (HTML) from the public docstrings with pdoc.

Usage::

    pip install ".[test]"          # pdoc is in the test extra
    python docs/build_api.py OUTPUT_DIR

``OUTPUT_DIR/index.html`` is the entry page; each public module has its page
(``OUTPUT_DIR/tf_dp/dp_query.html``, ...). Docstrings are rendered as written (reStructuredText
roles and ``>>>`` examples appear as text and code).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


#: the documented modules: the package and its public subpackages (each page lists the names of
#: the module's ``__all__``)
MODULES = (
    "tf_dp",
    "tf_dp.dp_query",
    "tf_dp.ledger",
    "tf_dp.accounting",
    "tf_dp.data",
    "tf_dp.gradients",
    "tf_dp.gradients.ghost",
    "tf_dp.engine",
    "tf_dp.keras",
    # the DP optimizers' bases: their attributes and methods (gradient_clipper, ledger,
    # set_sampling, ...) appear under every DP optimizer class as inherited members
    "tf_dp.keras.optimizer_settings",
    "tf_dp.keras.optimizer_sampling",
    "tf_dp.keras.optimizer_saving",
    "tf_dp.auditing",
)


def build(output_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes the reference into ``output_dir``; returns the HTML files written."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(ROOT))
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="restructuredtext", footer_text="tf_dp API reference")
    output_dir = pathlib.Path(output_dir)
    import importlib

    for module in MODULES:  # resolve lazy exports, so that pdoc sees them as attributes
        imported = importlib.import_module(module)
        for name in imported.__all__:
            getattr(imported, name)
    pdoc.pdoc(*MODULES, output_directory=output_dir)
    return sorted(output_dir.rglob("*.html"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=pathlib.Path, help="directory for the HTML files")
    args = parser.parse_args(argv)
    files = build(args.output_dir)
    print(f"wrote {len(files)} pages to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
