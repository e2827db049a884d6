"""Builds the tutorial notebooks (``tutorials/*.ipynb``) from their sources, without outputs.

Each notebook's text and code live in ``tutorials/_nb_<name>.py`` in the "percent" format
(as jupytext writes it): ``# %% [markdown]`` starts a markdown cell whose lines are comments,
``# %%`` starts a code cell, and ``# %% tags=["parameters"]`` a code cell with tags. This script
adds the parts every notebook shares, from ``tutorials/_colab.py``:

1. an "Open in Colab" badge (first cell), linking to the notebook on the project's GitHub;
2. after the source's first cell (title and introduction), the set-up cell, which installs tf_dp
   from the repository on Colab and does nothing where tf_dp is already importable.

Usage::

    python tutorials/_build_notebooks.py           # rewrite every notebook
    python tutorials/_build_notebooks.py --check   # exit 1 if a stored notebook differs

The stored notebooks have no outputs and no execution counts (``tests/test_notebooks.py`` checks
it, executes every notebook in small mode and checks the badge against ``_colab.py``).
"""

from __future__ import annotations

import ast
import os
import re
import sys

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _colab  # noqa: E402

#: Notebooks in reading order (``tutorials/README.md`` lists them in this order).
NOTEBOOKS = (
    "classification_privacy",
    "privacy_accounting",
    "migrating_from_tf_privacy",
    "custom_layers_and_ghost_clipping",
    "text_classification",
    "privacy_auditing",
    "dp_finetuning",
    "dp_large_data",
    "dp_user_level",
    "correlated_noise",
    "sparse_embeddings",
)

_MARKER = re.compile(r"^# %%(?P<kind> \[markdown\])?(?: tags=(?P<tags>\[.*\]))?\s*$")


def source_path(name: str) -> str:
    return os.path.join(HERE, f"_nb_{name}.py")


def notebook_path(name: str) -> str:
    return os.path.join(HERE, f"{name}.ipynb")


def available() -> list[str]:
    """The notebooks of :data:`NOTEBOOKS` whose source exists."""
    return [name for name in NOTEBOOKS if os.path.isfile(source_path(name))]


def setup_cell_source() -> str:
    requirement = _colab.pip_requirement()
    return (
        "# Set-up. On Colab this installs tf_dp from GitHub (a minute or two); where tf_dp is\n"
        "# already importable (a local checkout after `pip install -e .[tutorials]`), it does "
        "nothing.\n"
        "import importlib\n"
        "import importlib.util\n"
        "import subprocess\n"
        "import sys\n"
        "\n"
        'if importlib.util.find_spec("tf_dp") is None:\n'
        "    subprocess.check_call(\n"
        f'        [sys.executable, "-m", "pip", "install", "-q", "{requirement}"]\n'
        "    )\n"
        "    importlib.invalidate_caches()\n"
        "\n"
        "import tf_dp\n"
        "\n"
        'print("tf_dp", tf_dp.__version__)'
    )


def parse_source(text: str) -> list[tuple[str, str, list[str]]]:
    """Splits a percent-format source into ``(cell_type, source, tags)`` triples."""
    cells: list[tuple[str, list[str], list[str]]] = []
    for line in text.splitlines():
        match = _MARKER.match(line)
        if match:
            kind = "markdown" if match.group("kind") else "code"
            tags = ast.literal_eval(match.group("tags")) if match.group("tags") else []
            cells.append((kind, [], list(tags)))
        elif cells:
            cells[-1][1].append(line)
        elif line.strip() and not line.startswith("#"):
            raise ValueError(f"code before the first '# %%' marker: {line!r}")
    out = []
    for kind, lines, tags in cells:
        if kind == "markdown":
            bad = [ln for ln in lines if ln.strip() and not ln.startswith("#")]
            if bad:
                raise ValueError(f"markdown cell line is not a comment: {bad[0]!r}")
            lines = [ln[2:] if ln.startswith("# ") else ln[1:] for ln in lines]
        while lines and not lines[0].strip():
            lines.pop(0)
        while lines and not lines[-1].strip():
            lines.pop()
        if lines:
            out.append((kind, "\n".join(lines), tags))
    return out


def build(name: str) -> nbformat.NotebookNode:
    """The notebook ``name`` as it is stored: badge, source cells, set-up cell; no outputs."""
    with open(source_path(name), encoding="utf-8") as f:
        cells = parse_source(f.read())
    filename = f"{name}.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "colab": {"name": filename, "provenance": []},
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    new = [nbformat.v4.new_markdown_cell(_colab.badge_markdown(filename))]
    for i, (kind, source, tags) in enumerate(cells):
        if kind == "markdown":
            cell = nbformat.v4.new_markdown_cell(source)
        else:
            cell = nbformat.v4.new_code_cell(source)
        if tags:
            cell.metadata["tags"] = tags
        new.append(cell)
        if i == 0:
            new.append(nbformat.v4.new_code_cell(setup_cell_source()))
    for i, cell in enumerate(new):
        cell.id = f"cell-{i:02d}"
    nb.cells = new
    nbformat.validate(nb)
    return nb


def main(argv: list[str]) -> int:
    check = "--check" in argv[1:]
    stale = []
    for name in available():
        text = nbformat.writes(build(name))
        if not text.endswith("\n"):
            text += "\n"
        path = notebook_path(name)
        current = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if current == text:
            continue
        if check:
            stale.append(path)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {os.path.relpath(path)}")
    if stale:
        print("out of date (run python tutorials/_build_notebooks.py):\n  " + "\n  ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
