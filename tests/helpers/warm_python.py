"""Runs a Python program as ``subprocess.run([sys.executable, ...])`` would, in a process forked
from a warm interpreter that has already imported numpy, SciPy, TensorFlow and Keras.

A test that needs a process of its own (a logical-device configuration, a crash that must not
kill the test worker, a fresh tf_dp import) pays about 7 s of CPU for Python's start and those
imports; many tests do. :func:`run` sends the program to a server process (one per test worker,
started on first use) that forks a child for it: the child gets the given arguments, environment,
working directory and ``sys.path`` (built as Python builds it: the script's folder or the working
directory, then ``PYTHONPATH``, then the interpreter's own), runs the program as ``__main__``
(``script.py``, ``-c CODE`` or ``-m MODULE``), then joins its threads and runs the ``atexit``
handlers as an interpreter exit does. Its output goes to files that :func:`run` returns as
``subprocess.run(..., capture_output=True, text=True)`` does; a timeout kills the child's process
group and raises ``subprocess.TimeoutExpired``. tf_dp itself is not preloaded: each child imports
it from its own ``sys.path``.

What the warm interpreter cannot give falls back to a real subprocess: an environment that changes
a variable read when TensorFlow or Keras is imported (``KERAS_*``, ``TF_ENABLE_ONEDNN_OPTS``,
``PYTHONHASHSEED``, ...), or a program that is not ``script``, ``-c`` or ``-m``. TensorFlow creates
its thread pools and devices when first used, not when imported, so a child still configures
logical devices, thread counts and ``TF_CONFIG`` as a fresh process does.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types

PRELOAD = ("numpy", "scipy", "scipy.stats", "scipy.special", "tensorflow", "keras")
#: variables read when TensorFlow or Keras is imported (or at Python's start): a child whose
#: environment changes one of them runs in a real subprocess instead
IMPORT_TIME = ("KERAS_", "TF_ENABLE_ONEDNN_OPTS", "PYTHONHASHSEED", "PYTHONOPTIMIZE",
               "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "PYTHONUTF8", "OMP_")

_server: subprocess.Popen | None = None
_server_env: dict | None = None
_lock = threading.Lock()


def _import_time_changes(env: dict, server_env: dict) -> bool:
    """Whether ``env`` differs from the server's in a variable read at import time."""
    return any(k.startswith(IMPORT_TIME) and env.get(k) != server_env.get(k)
               for k in set(env) | set(server_env))


def _start() -> dict:
    """Starts the server unless it runs; returns its environment."""
    global _server, _server_env
    if _server is None or _server.poll() is not None:
        _server_env = dict(os.environ)
        _server_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        _server = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_server_env, text=True)
        atexit.register(_server.kill)
    return _server_env


def run(args, *, env=None, cwd=None, timeout=None, capture_output=True, text=True, check=False,
        **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, ...)`` for ``args = [sys.executable,
    program...]``, run in a child of the warm interpreter when it can be (module docstring)."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    warm = (capture_output and text and not kwargs and args[0] == sys.executable
            and len(args) > 1 and (args[1] in ("-c", "-m") or not args[1].startswith("-")))
    with _lock, tempfile.TemporaryDirectory(prefix="warm_python_") as tmp:
        if not warm or _import_time_changes(env, _start()):
            return subprocess.run(args, env=env, cwd=cwd, timeout=timeout,
                                  capture_output=capture_output, text=text, check=check, **kwargs)
        server = _server
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = {"argv": args[1:], "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
                   "timeout": timeout, "stdout": out, "stderr": err}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
        if not line:
            raise RuntimeError("tests/helpers/warm_python.py: the server process died")
        reply = json.loads(line)
        with open(out, encoding="utf-8", errors="replace") as f:
            stdout = f.read()
        with open(err, encoding="utf-8", errors="replace") as f:
            stderr = f.read()
    if reply.get("timeout"):
        raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
    result = subprocess.CompletedProcess(args, reply["returncode"], stdout, stderr)
    if check:
        result.check_returncode()
    return result


# ----------------------------------------------------------------------------- the server


def _child(request: dict, site_path: list) -> None:
    """In the forked child: becomes the requested program, then exits as an interpreter does."""
    os.setpgrp()  # its own process group: a timeout kills what it started too
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY),
                           (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                           (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, mode, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = request["argv"]
    python_path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv[:] = ["-c", *argv[2:]]
            sys.path[:] = ["", *python_path, *site_path]
            main = types.ModuleType("__main__")  # a real __main__ module, as python -c has
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # noqa: S102
        elif argv[0] == "-m":
            sys.argv[:] = [argv[1], *argv[2:]]
            sys.path[:] = [os.getcwd(), *python_path, *site_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv[:] = list(argv)
            sys.path[:] = [os.path.dirname(script), *python_path, *site_path]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 -- reported as Python reports an uncaught exception
        traceback.print_exc()
        code = 1
    try:  # an interpreter's exit: non-daemon threads joined, atexit handlers run
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code & 0xFF)


def _serve() -> None:
    for name in PRELOAD:
        __import__(name)
    requests = sys.stdin
    replies = os.fdopen(os.dup(1), "w")  # the replies' pipe; fd 1 itself to /dev/null, so that
    devnull = os.open(os.devnull, os.O_WRONLY)  # nothing printed here can corrupt a reply
    os.dup2(devnull, 1)
    os.close(devnull)
    own = os.path.dirname(os.path.abspath(__file__))
    startup_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    site_path = [p for p in sys.path if p and p != own and p not in startup_path]
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        replies.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            _child(request, site_path)
        deadline = None if request["timeout"] is None else time.monotonic() + request["timeout"]
        reply = {}
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                reply["returncode"] = (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                                       else os.WEXITSTATUS(status))
                break
            if deadline is not None and time.monotonic() > deadline:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                reply = {"timeout": True, "returncode": -signal.SIGKILL}
                break
            time.sleep(0.02)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
