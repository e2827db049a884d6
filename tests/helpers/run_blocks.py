"""Runs a document's ```python blocks one after another in this interpreter (tests/test_docs_blocks.py).

Usage: ``python run_blocks.py BLOCKS.json RESULTS.jsonl WORKDIR``. ``BLOCKS.json`` is a list of
``{"index": i, "code": "..."}``; for each block, in order, one JSON line ``{"index": i, "ok":
bool, "error": str, "seconds": float}`` is appended to ``RESULTS.jsonl`` (flushed at once, so
that if the process dies in a block the caller knows which one, and runs the rest in a new
process).

Each block runs as a script would: its own namespace (``__name__ == "__main__"``, no name left by
an earlier block), its own empty working directory under ``WORKDIR``, a ``DeprecationWarning``
raised by its own code an error. What one block may change in the interpreter's global state is
put back before the next: Keras's session (name counters, graph), its global dtype policy, the
custom objects the block registered, ``os.environ``, ``sys.argv`` and the working directory. Sharing the
interpreter saves the import of TensorFlow, Keras and tf_dp (several seconds) per block.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings


def _keras_state():
    """A function putting back the global Keras state a block may change (as it is now)."""
    import keras
    from keras.src.saving import object_registration as registry

    policy = keras.config.dtype_policy().name

    def restore():
        keras.config.set_dtype_policy(policy)
        # the block's own registered classes (defined in its "__main__"), not what an import of
        # a library module registered on the way (the module stays imported)
        for table in (registry.GLOBAL_CUSTOM_OBJECTS, registry.GLOBAL_CUSTOM_NAMES):
            for key, value in list(table.items()):
                obj = value if table is registry.GLOBAL_CUSTOM_OBJECTS else key
                if getattr(obj, "__module__", None) == "__main__":
                    del table[key]
        keras.backend.clear_session()

    return restore


def _run(code: str, workdir: str) -> tuple[bool, str]:
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    namespace = {"__name__": "__main__", "__file__": os.path.join(workdir, "block.py")}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=DeprecationWarning, module="__main__")
        try:
            exec(compile(code, namespace["__file__"], "exec"), namespace)  # noqa: S102
        except SystemExit as e:  # a block may end with sys.exit(0)
            if e.code not in (None, 0):
                return False, f"SystemExit({e.code!r})"
        except BaseException:  # noqa: BLE001 -- every failure of the block is reported
            return False, traceback.format_exc()[-3000:]
    return True, ""


def main(blocks_path: str, results_path: str, workdir: str) -> None:
    with open(blocks_path, encoding="utf-8") as f:
        blocks = json.load(f)
    environ, argv = dict(os.environ), list(sys.argv)
    restore = _keras_state()
    with open(results_path, "a", encoding="utf-8") as out:
        for block in blocks:
            start = time.monotonic()
            ok, error = _run(block["code"], os.path.join(workdir, f"block{block['index']}"))
            seconds = time.monotonic() - start
            sys.stdout.flush()
            sys.stderr.flush()
            out.write(json.dumps({"index": block["index"], "ok": ok, "error": error,
                                  "seconds": round(seconds, 2)}) + "\n")
            out.flush()
            restore()
            os.environ.clear()
            os.environ.update(environ)
            sys.argv[:] = argv


if __name__ == "__main__":
    main(*sys.argv[1:4])
