"""tests/helpers/warm_python.py: a program run in a child of the warm interpreter sees what
``subprocess.run([sys.executable, ...])`` would give it, and its caller sees what subprocess.run
would return (exit codes, signals, output, timeouts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import warm_python

PROBE = (
    "import json, os, sys\n"
    "print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'path0': sys.path[0],"
    " 'pythonpath': os.environ.get('PYTHONPATH'), 'var': os.environ.get('WARM_PROBE'),"
    " 'main': sys.modules['__main__'].__dict__.get('MARK'), 'name': __name__,"
    " 'tf_dp': 'tf_dp' in sys.modules}))\n"
)


def _both(args, **kwargs):
    cold = subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)
    warm = warm_python.run(args, capture_output=True, text=True, timeout=120, **kwargs)
    return cold, warm


def test_c_program_sees_argv_cwd_environment_and_path_as_python_gives_them(tmp_path):
    env = dict(os.environ, WARM_PROBE="x", PYTHONPATH=str(tmp_path / "extra"))
    cold, warm = _both([sys.executable, "-c", "MARK = 1\n" + PROBE, "a", "b"], cwd=tmp_path,
                       env=env)
    assert cold.returncode == warm.returncode == 0, (cold.stderr, warm.stderr)
    assert json.loads(warm.stdout) == json.loads(cold.stdout)
    got = json.loads(warm.stdout)
    assert got["argv"] == ["-c", "a", "b"] and got["var"] == "x" and got["main"] == 1
    assert got["tf_dp"] is False  # nothing of the project is preloaded


def test_script_and_module_programs(tmp_path):
    (tmp_path / "probe_script.py").write_text("MARK = 2\n" + PROBE)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    for args in ([sys.executable, str(tmp_path / "probe_script.py"), "z"],
                 [sys.executable, "-m", "probe_script", "z"]):
        cold, warm = _both(args, cwd=tmp_path, env=env)
        assert cold.returncode == warm.returncode == 0, (args, cold.stderr, warm.stderr)
        want, got = json.loads(cold.stdout), json.loads(warm.stdout)
        assert got == want, args
        assert got["name"] == "__main__" and got["argv"][1:] == ["z"]


@pytest.mark.parametrize("code, want", [
    ("import sys; sys.exit(3)", 3),
    ("import os; os._exit(7)", 7),
    ("raise ValueError('boom')", 1),
    ("import sys; sys.exit('a message')", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", -11),
])
def test_exit_codes_signals_and_tracebacks_are_reported_as_subprocess_reports_them(code, want):
    cold, warm = _both([sys.executable, "-c", code])
    assert cold.returncode == warm.returncode == want
    if "boom" in code:
        assert warm.stderr.splitlines()[-1] == cold.stderr.splitlines()[-1] == "ValueError: boom"
        assert warm.stderr.startswith("Traceback (most recent call last):")
    if "message" in code:
        assert warm.stderr.strip() == cold.stderr.strip() == "a message"


def test_threads_are_joined_and_atexit_handlers_run_at_exit():
    code = (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "def late():\n"
        "    time.sleep(0.3); print('thread done', flush=True)\n"
        "threading.Thread(target=late).start()\n"
        "print('main done', flush=True)\n"
    )
    cold, warm = _both([sys.executable, "-c", code])
    assert warm.stdout.split("\n") == cold.stdout.split("\n") == [
        "main done", "thread done", "atexit ran", ""]


def test_a_timeout_kills_the_program_and_what_it_started():
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print('started', flush=True); time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as info:
        warm_python.run([sys.executable, "-c", code], timeout=3)
    assert "started" in info.value.output
    after = warm_python.run([sys.executable, "-c", "print('next')"], timeout=60)
    assert after.stdout == "next\n"  # the server goes on


def test_an_import_time_variable_gets_a_real_process():
    # KERAS_BACKEND is read when Keras is imported: the warm interpreter has imported it already
    env = dict(os.environ, KERAS_BACKEND="numpy")
    code = "import keras; print(keras.backend.backend())"
    warm = warm_python.run([sys.executable, "-c", code], env=env, timeout=120)
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert warm.stdout.strip().splitlines()[-1] == "numpy"
