"""BUILD covers the tree: every module under tf_dp/ and every Python file under tests/ is a source
(or data) of one of its targets, each test file has its own py_test, and each py_library's deps
name every package its modules import.

BUILD is read by evaluating it with stand-ins for the Bazel functions it calls (``glob`` expanded
over the working tree), not by running Bazel.
"""

from __future__ import annotations

import pathlib

from tests.test_imports import GRAPH, MODULES

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _glob(include, exclude=(), allow_empty=False):
    found = set()
    for pattern in include:
        found |= {p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern) if p.is_file()}
    for pattern in exclude:
        found -= {p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)}
    assert found or allow_empty, f"glob({include}) matches nothing"
    return sorted(found)


def read_build(text: str) -> dict[str, dict]:
    """``name -> {"kind", "srcs", "data", "deps"}`` for every target ``text`` declares."""
    targets = {}

    def rule(kind):
        def declare(name, srcs=(), data=(), deps=(), **_):
            assert name not in targets, f"two targets named {name!r}"
            targets[name] = {
                "kind": kind,
                "srcs": list(srcs),
                "data": list(data),
                "deps": [d.lstrip(":") for d in deps],
            }

        return declare

    scope = {
        "load": lambda *a, **k: None,
        "package": lambda **k: None,
        "licenses": lambda *a: None,
        "glob": _glob,
        "py_library": rule("py_library"),
        "py_test": rule("py_test"),
    }
    exec(compile(text, "BUILD", "exec"), scope)
    return targets


TARGETS = read_build((ROOT / "BUILD").read_text())


def _files(under: str) -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / under).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def test_every_tf_dp_module_is_a_source_of_one_library():
    owners = {}
    for name, t in TARGETS.items():
        for src in t["srcs"]:
            if src.startswith("tf_dp/"):
                owners.setdefault(src, []).append(name)
    assert {f: o for f, o in owners.items() if len(o) > 1} == {}
    assert sorted(_files("tf_dp") - set(owners)) == []


def test_every_test_file_has_a_py_test_and_every_tests_file_is_covered():
    tests = [t for t in TARGETS.values() if t["kind"] == "py_test"]
    test_files = {p for p in _files("tests") if pathlib.PurePath(p).name.startswith("test_")}
    with_target = {s for t in tests for s in t["srcs"] if s in test_files}
    assert sorted(test_files - with_target) == []
    covered = {f for t in TARGETS.values() for f in t["srcs"] + t["data"]}
    assert sorted(_files("tests") - covered) == []


def test_library_deps_name_every_package_their_modules_import():
    library_of = {}
    for name, t in TARGETS.items():
        for src in t["srcs"]:
            if src.startswith("tf_dp/"):
                library_of[src] = name
    missing = set()
    for module, targets in GRAPH.items():
        own = library_of[MODULES[module].relative_to(ROOT).as_posix()]
        for target in targets:
            dep = library_of[MODULES[target].relative_to(ROOT).as_posix()]
            # the root's exports are lazy: the whole-package target ``tf_dp`` provides them
            deps = TARGETS["tf_dp" if own == "tf_dp_init" else own]["deps"]
            if dep != own and dep not in deps:
                missing.add((own, dep, module))
    assert sorted(missing) == []


def test_the_reader_sees_a_file_left_out():
    text = 'py_library(name = "x", srcs = glob(["tf_dp/dp_query/*.py"]))'
    srcs = read_build(text)["x"]["srcs"]
    assert "tf_dp/dp_query/gaussian_query.py" in srcs and "tf_dp/ledger/events.py" not in srcs
