"""Adversarial run: bad inputs, malformed files and faults against tf_dp, each classified.

``python -m research.reliability.adversarial [--timeout 60] [--memory_gb 4] [--only PREFIX]
[--json out.json]``

Bad inputs (``input:``): every numeric argument of the public constructors and functions listed
in ``NUMERIC_TARGETS`` gets the values of its kind (out of range, NaN, inf, beyond int64, a
string, a bool, None where a number is required). Malformed files (``file:``): a valid ledger
file, journal and audit report file, each truncated at several offsets, bit-flipped at several
bytes, re-signed with forged counts (the checksum recomputed, so only the range checks stand),
nested thousands of levels deep, re-encoded (UTF-16, Latin-1 bytes, a BOM), empty and binary,
read by every public reader of that file. Each case is classified:

- ``clear``: a ``ValueError`` / ``TypeError`` (tf_dp's ``LedgerFileError`` is one) whose message
  names the argument (or the file);
- ``raw``: any other exception, or one that names neither (a defect);
- ``silent``: no error at all (a defect);
- ``crash`` / ``hang`` / ``oom``: the process died, outlived ``--timeout`` or met the memory
  limit (``RLIMIT_AS``, ``--memory_gb``) (defects).

Cases run in worker subprocesses under the memory limit, many per worker (one import of
TensorFlow per worker), each under its own alarm; a worker that dies is restarted after the case
it died on, which is then re-run alone in a fresh process to classify it.

Faults (``fault:``), each in fresh processes: a process journaling steps killed (SIGKILL) at
random moments while it appends; a ledger file rewritten while killed; a full disk (the file size
limit ``RLIMIT_FSIZE`` hit while writing a ledger file and a journal); two writers on one
journal. For each: steps lost (the file after the fault holds fewer steps than the writer had
reported durable) or not, and whether the error was clear.

The counts and the defects are printed; research/reliability/README.md holds the last run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# -- bad inputs -------------------------------------------------------------------------------

#: Bad values by kind of argument (Python source, evaluated in the worker).
BAD = {
    "pos_int": ["0", "-1", "2.5", "10**30", "float('nan')", "'3'", "True"],
    "pos_float": ["0.0", "-1.0", "float('nan')", "float('inf')", "'1'", "None", "1e400"],
    "nonneg_float": ["-1.0", "float('nan')", "float('inf')", "'1'", "-1e-300"],
    "prob": ["0.0", "-0.1", "1.5", "float('nan')", "float('inf')", "'0.1'", "1e-300"],
    "open_prob": ["0.0", "1.0", "-0.1", "float('nan')", "'1e-5'", "2.0"],
    "count": ["0", "-5", "10**30", "1.5", "float('inf')", "'10'", "True"],
}

_X = "np.zeros((40, 3), np.float32)"
_Y = "np.zeros(40, np.int32)"
_OPT = "tf_dp.keras.DPKerasSGDOptimizer"

#: (name, call template with {v} for the bad value, argument name, kind[, values of the kind
#: that are valid for this argument: accepting them is no defect]).
NUMERIC_TARGETS = [
    (_OPT, f"{_OPT}(l2_norm_clip={{v}}, noise_multiplier=1.0, learning_rate=0.1)",
     "l2_norm_clip", "pos_float"),
    (_OPT, f"{_OPT}(l2_norm_clip=1.0, noise_multiplier={{v}}, learning_rate=0.1)",
     "noise_multiplier", "nonneg_float"),
    (_OPT, f"{_OPT}(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches={{v}})",
     "num_microbatches", "pos_int"),
    (_OPT, f"{_OPT}(l2_norm_clip=1.0, noise_multiplier=1.0, max_physical_batch_size={{v}})",
     "max_physical_batch_size", "pos_int"),
    ("GaussianSumQuery", "tf_dp.dp_query.GaussianSumQuery(l2_norm_clip={v}, stddev=1.0)",
     "l2_norm_clip", "pos_float", {"0.0"}),  # clip 0: every record clipped to 0 (no data)
    ("GaussianSumQuery", "tf_dp.dp_query.GaussianSumQuery(l2_norm_clip=1.0, stddev={v})",
     "stddev", "nonneg_float"),
    ("Sampling", "tf_dp.engine.Sampling({v}, 0.01)", "population_size", "count"),
    ("Sampling", "tf_dp.engine.Sampling(1000, {v})", "selection_probability", "prob"),
    ("poisson_batches", f"tf_dp.data.poisson_batches({_X}, {_Y}, sampling_probability={{v}})",
     "sampling_probability", "prob"),
    ("poisson_batches",
     f"tf_dp.data.poisson_batches({_X}, {_Y}, sampling_probability=0.1, steps_per_epoch={{v}})",
     "steps_per_epoch", "pos_int"),
    ("poisson_batches",
     f"tf_dp.data.poisson_batches({_X}, {_Y}, sampling_probability=0.1, max_batch_size={{v}})",
     "max_batch_size", "pos_int"),
    ("poisson_batches",
     f"tf_dp.data.poisson_batches({_X}, {_Y}, sampling_probability=0.1, pad_sizes=[{{v}}])",
     "pad_sizes", "pos_int"),
    ("truncated_poisson_batches",
     f"tf_dp.data.truncated_poisson_batches({_X}, {_Y}, sampling_probability={{v}})",
     "sampling_probability", "prob"),
    ("balls_in_bins_batches", f"tf_dp.data.balls_in_bins_batches({_X}, {_Y}, batch_size={{v}})",
     "batch_size", "pos_int"),
    ("default_max_batch_size", "tf_dp.data.default_max_batch_size({v}, 0.01)",
     "population_size", "count"),
    ("default_max_batch_size", "tf_dp.data.default_max_batch_size(1000, {v})",
     "sampling_probability", "prob"),
    ("dp_sgd_epsilon", "tf_dp.accounting.dp_sgd_epsilon({v}, 256, 1.1, 1e-5, epochs=1)",
     "n", "count"),
    ("dp_sgd_epsilon", "tf_dp.accounting.dp_sgd_epsilon(60000, {v}, 1.1, 1e-5, epochs=1)",
     "batch_size", "count"),
    ("dp_sgd_epsilon", "tf_dp.accounting.dp_sgd_epsilon(60000, 256, {v}, 1e-5, epochs=1)",
     "noise_multiplier", "pos_float", {"0.0"}),  # no noise: epsilon = inf, correctly
    ("dp_sgd_epsilon", "tf_dp.accounting.dp_sgd_epsilon(60000, 256, 1.1, {v}, epochs=1)",
     "delta", "open_prob"),
    ("dp_sgd_epsilon", "tf_dp.accounting.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, steps={v})",
     "steps", "count"),
    ("dp_sgd_epsilon", "tf_dp.accounting.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs={v})",
     "epochs", "pos_float"),
    ("calibrate_noise_multiplier",
     "tf_dp.accounting.calibrate_noise_multiplier({v}, 1e-5, 60000, 256, epochs=1)",
     "target_epsilon", "pos_float"),
    ("calibrate_noise_multiplier",
     "tf_dp.accounting.calibrate_noise_multiplier(1.0, {v}, 60000, 256, epochs=1)",
     "delta", "open_prob"),
    ("epsilon_from_rdp", "tf_dp.accounting.epsilon_from_rdp([2.0, 4.0], [{v}, 1.0], 1e-5)",
     "rdp", "nonneg_float", {"float('inf')"}),  # an infinite divergence at one order
    ("epsilon_from_rdp", "tf_dp.accounting.epsilon_from_rdp([2.0, 4.0], [0.5, 1.0], {v})",
     "delta", "open_prob"),
    ("epsilon_from_mu", "tf_dp.accounting.epsilon_from_mu(1e-5, {v})", "mu", "nonneg_float",
     {"float('inf')"}),  # mu = inf: epsilon = inf
    ("mu_poisson", "tf_dp.accounting.mu_poisson({v}, 1.1, 100)", "q", "prob", {"0.0"}),
    ("mu_poisson", "tf_dp.accounting.mu_poisson(0.01, {v}, 100)", "noise_multiplier",
     "pos_float", {"float('inf')", "1e400"}),  # infinite noise: mu = 0
    ("pld_epsilon", "tf_dp.accounting.pld_epsilon([(tf_dp.accounting.SubsampledGaussian("
     "0.01, 1.1), 10)], 1e-5, h={v})", "h", "pos_float", {"None"}),  # None: the default grid
    ("rdp_poisson_gaussian", "tf_dp.accounting.rdp_poisson_gaussian({v}, 1.1)", "q", "prob",
     {"0.0"}),  # q = 0: zero divergence
    ("record_sampling", "tf_dp.PrivacyLedger().record_sampling({v}, 0.01, 'poisson')",
     "population_size", "count"),
    ("record_sampling", "tf_dp.PrivacyLedger().record_sampling(1000, {v}, 'poisson')",
     "selection_probability", "prob"),
]

#: Bad types and structures: (name, code, words a clear message names).
OTHER_INPUTS = [
    ("poisson_batches x=None", "tf_dp.data.poisson_batches(None, [1, 2], 0.5)", ["x"]),
    ("poisson_batches ragged", "tf_dp.data.poisson_batches([[1], [1, 2]], [0, 1], 0.5)", ["x"]),
    ("poisson_batches y rows", f"tf_dp.data.poisson_batches({_X}, np.zeros(3), 0.5)", ["y"]),
    ("poisson_batches dataset", "tf_dp.data.poisson_batches(tf.data.Dataset.range(3), "
     "np.zeros(3), 0.5)", ["x"]),
    ("validate_for_dp int", "tf_dp.keras.validate_for_dp(42)", ["model"]),
    ("make_private str", "tf_dp.keras.make_private('model')", ["model"]),
    ("optimizer policy", "tf_dp.engine.Sampling(10, 0.1, policy='sometimes')", ["policy"]),
    ("compute_epsilon str", "tf_dp.accounting.compute_epsilon('nothing', 1e-5)", ["ledger"]),
    ("compute_epsilon accountant", "tf_dp.accounting.compute_epsilon([], 1e-5, "
     "accountant='magic')", ["accountant"]),
    ("restore_runs negative", "tf_dp.PrivacyLedger().restore_runs([(ENTRY, -3)])", ["count"]),
    ("restore_runs 1e30", "tf_dp.PrivacyLedger().restore_runs([(ENTRY, 10**30)])", ["count"]),
    ("load_tables NaN", "tf_dp.PrivacyLedger().load_tables(np.full((2, 8), np.nan), "
     "np.zeros((0, 7)))", ["ledger"]),
    ("load_tables run counts", "tf_dp.PrivacyLedger().load_tables(np.array([[100, 0.1, 0, 0, 0, 0,"
     " 0, 0, 1e300]]), np.zeros((0, 7)))", ["count"]),
    ("LedgerCheckpoint empty", "tf_dp.keras.callbacks.LedgerCheckpoint('')", ["filepath"]),
    # ('{nokey}' may be a log key: refused after the first step, test_bad_input_more)
    ("LedgerCheckpoint key", "tf_dp.keras.callbacks.LedgerCheckpoint('{nokey}.json')",
     ["filepath"], True),
    ("audit num_canaries", "tf_dp.auditing.audit_dp_sgd(lambda: None, lambda: None, "
     f"{_X}, {_Y}, loss='mse', num_canaries=10**9)", ["num_canaries"]),
]


def input_cases() -> list[dict]:
    cases = []
    for name, template, arg, kind, *valid in NUMERIC_TARGETS:
        for v in BAD[kind]:
            cases.append({"id": f"input:{name}:{arg}={v}", "code": template.format(v=v),
                          "names": [arg],
                          # a tiny probability is a valid one: accepting it is no defect
                          "may_accept": v == "1e-300" or v in (valid[0] if valid else ())})
    for name, code, names, *may in OTHER_INPUTS:
        cases.append({"id": f"input:{name}", "code": code, "names": names,
                      "may_accept": bool(may)})
    return cases


# -- malformed files --------------------------------------------------------------------------

def _valid_files(directory: str) -> dict:
    """A valid ledger file, journal and audit report in ``directory`` (made in this process,
    which imports tf_dp's pure-Python writers only)."""
    sys.path.insert(0, ROOT)
    from tf_dp.auditing.report_file import write_report_file
    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
    from tf_dp.ledger.journal import LedgerJournal
    from tf_dp.ledger.ledger_file import write_ledger_runs

    a = SampleEntry(SamplingEvent(60000, 256 / 60000), (SumQueryEvent(1.0, 1.1),))
    b = SampleEntry(SamplingEvent(60000, 256 / 60000), (SumQueryEvent(1.0, 2.0),))
    paths = {k: os.path.join(directory, f"valid.{k}") for k in ("ledger", "journal", "report")}
    write_ledger_runs(paths["ledger"], [(a, 700), (b, 5)])
    j = LedgerJournal(paths["journal"])
    j.append_runs([(a, 40)], 0)
    j.append_runs([(b, 3)], 40)
    j.close()
    write_report_file(paths["report"], {"epsilon_lower_bound": 0.5, "num_canaries": 100,
                                        "trainings": 1})
    return paths


def _resign_ledger(data: bytes, count: int) -> bytes:
    """The ledger file with its first run's count (and num_samples) forged, checksum recomputed."""
    from tf_dp.ledger.ledger_file import _canonical

    payload = json.loads(data)
    old = payload["runs"][0]["count"]
    payload["runs"][0]["count"] = count
    payload["num_samples"] = payload["num_samples"] - old + count
    payload.pop("sha256")
    payload["sha256"] = __import__("hashlib").sha256(_canonical(payload)).hexdigest()
    return json.dumps(payload).encode()


def _resign_journal(data: bytes, count: int) -> bytes:
    from tf_dp.ledger.journal import _digest
    from tf_dp.ledger.ledger_file import _canonical

    lines = data.split(b"\n")
    out = [lines[0]]
    for line in lines[1:]:
        if not line:
            continue
        rec = json.loads(line)
        rec["runs"][0]["count"] = count
        rec["sha256"] = _digest(rec["start"], _canonical(rec["runs"]).decode())
        out.append(json.dumps(rec).encode())
    return b"\n".join(out) + b"\n"


READERS = {
    "ledger": [("PrivacyLedger.load", "tf_dp.PrivacyLedger.load(PATH)"),
               ("read_ledger_runs", "tf_dp.ledger.read_ledger_runs(PATH)"),
               ("compute_epsilon", "tf_dp.accounting.compute_epsilon("
                "tf_dp.ledger.read_ledger_runs(PATH), 1e-5)")],
    "journal": [("read_journal_runs", "tf_dp.ledger.journal.read_journal_runs(PATH)"),
                ("attach_journal", "tf_dp.PrivacyLedger().attach_journal(PATH)")],
    "report": [("read_report_file", "tf_dp.auditing.report_file.read_report_file(PATH)")],
}


def file_cases(directory: str) -> list[dict]:
    valid = _valid_files(directory)
    cases = []
    for kind, path in valid.items():
        data = open(path, "rb").read()
        variants = {"empty": b"", "binary": bytes(range(256)) * 4,
                    "utf16": data.decode().encode("utf-16"),
                    "latin1": data.replace(b"0", "\xe9".encode("latin-1"), 3),
                    "bom": b"\xef\xbb\xbf" + data,
                    "deep": b"[" * 200000 + b"]" * 200000,
                    "deep_line": (data.split(b"\n")[0] + b"\n" + b"{\"start\":" + b"[" * 100000
                                  + b"\n") if kind == "journal" else b"{\"a\":" * 100000}
        for frac in (0.1, 0.5, 0.9, 0.99):
            variants[f"truncated{frac}"] = data[: int(len(data) * frac)]
        for frac in (0.05, 0.3, 0.6, 0.95):
            i = min(len(data) - 2, int(len(data) * frac))
            variants[f"bitflip{frac}"] = data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:]
        if kind == "ledger":
            for count in (10**7, 10**9, 10**16, 0, -1):
                variants[f"resigned_count={count}"] = _resign_ledger(data, count)
        if kind == "journal":
            for count in (10**9, 10**16, 0, -1):
                variants[f"resigned_count={count}"] = _resign_journal(data, count)
        for vname, content in variants.items():
            p = os.path.join(directory, f"{kind}.{vname}")
            with open(p, "wb") as f:
                f.write(content)
            for rname, code in READERS[kind]:
                cases.append({"id": f"file:{kind}:{vname}:{rname}",
                              "code": code.replace("PATH", repr(p)),
                              "names": [os.path.basename(p), "file", "journal", "ledger",
                                        "report"],
                              # a forged count within range is a valid file (the checksum is
                              # no signature); a journal's torn tail (no newline: truncated,
                              # empty, one unterminated line) is ignored by design
                              "may_accept": vname.startswith(("resigned_count=10000000",
                                                              "resigned_count=1000000000",
                                                              "bom")) or (
                                  kind == "journal" and vname.startswith(
                                      ("truncated", "empty", "deep")))})
    return cases


# -- the worker -------------------------------------------------------------------------------

_PRELUDE = """
import numpy as np, tensorflow as tf, tf_dp, tf_dp.keras, tf_dp.keras.callbacks, tf_dp.auditing
import tf_dp.ledger.journal, tf_dp.auditing.report_file
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
ENTRY = SampleEntry(SamplingEvent(1000, 0.01), (SumQueryEvent(1.0, 1.0),))
"""


def _classify(case: dict, error: BaseException | None) -> tuple[str, str]:
    if error is None:
        return ("accepted" if case.get("may_accept") else "silent"), ""
    message = f"{type(error).__name__}: {error}"[:300]
    if isinstance(error, MemoryError):
        return "oom", message
    if isinstance(error, TimeoutError) and "adversarial alarm" in str(error):
        return "hang", message
    if isinstance(error, (ValueError, TypeError)) and not isinstance(
        error, (UnicodeDecodeError, json.JSONDecodeError)
    ):
        text = str(error).lower()
        if any(n.lower() in text for n in case["names"]):
            return "clear", message
    return "raw", message


def worker(timeout: float, memory_gb: float) -> None:
    limit = int(memory_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.setrecursionlimit(3000)
    namespace: dict = {}
    exec(_PRELUDE, namespace)

    def alarm(*_):
        raise TimeoutError("adversarial alarm")

    signal.signal(signal.SIGALRM, alarm)
    print("READY", flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        error = None
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            exec(case["code"], dict(namespace))
        except BaseException as e:  # noqa: BLE001 (every outcome is classified)
            error = e
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        outcome, message = _classify(case, error)
        print(json.dumps({"id": case["id"], "outcome": outcome, "message": message}), flush=True)


def _start_worker(timeout: float, memory_gb: float) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-m", "research.reliability.adversarial", "--worker",
         "--timeout", str(timeout), "--memory_gb", str(memory_gb)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""},
    )
    while True:  # wait for the imports
        line = p.stdout.readline()
        if not line or line.startswith("READY"):
            return p


def _death(p: subprocess.Popen) -> str:
    rc = p.poll()
    if rc is not None and rc < 0 and -rc == signal.SIGKILL:
        return "oom"  # killed: the kernel's OOM killer (the alarm would have said hang)
    return "crash"


def run_cases(cases: list[dict], timeout: float, memory_gb: float) -> list[dict]:
    results, pending = [], list(cases)
    while pending:
        p = _start_worker(timeout, memory_gb)
        while pending:
            case = pending[0]
            try:
                p.stdin.write(json.dumps(case) + "\n")
                p.stdin.flush()
            except BrokenPipeError:
                pass
            # the worker's own alarm fires at `timeout`; a hard deadline covers a stuck C call
            line = _read_line(p, timeout + 30)
            if line is None:  # dead or stuck: the case again alone in a fresh worker
                stuck = p.poll() is None
                if stuck:
                    p.kill()
                p.wait()
                if not case.get("retried"):
                    case["retried"] = True
                    break
                outcome = "hang" if stuck else _death(p)
                results.append({"id": case["id"], "outcome": outcome,
                                "message": f"worker exit {p.returncode}"})
                pending.pop(0)
                break
            results.append(json.loads(line))
            pending.pop(0)
        else:
            p.stdin.close()
            p.wait()
    return results


def _read_line(p: subprocess.Popen, seconds: float):
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    if not sel.select(seconds):
        return None
    line = p.stdout.readline()
    return line or None


# -- faults -----------------------------------------------------------------------------------

_JOURNAL_WRITER = """
import sys, tf_dp
ledger = tf_dp.PrivacyLedger()
ledger.attach_journal(sys.argv[1], fsync=True)
i = 0
while True:
    ledger.record_sampling(60000, 0.004 + (i // 7) * 1e-6, "poisson")
    ledger.record_sum_query(1.0, 1.1)
    ledger.flush()                      # the journal holds step i once flush returns
    i += 1
    print(i, flush=True)
"""

_FILE_WRITER = """
import sys, tf_dp
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.ledger_file import write_ledger_runs
i = 0
while True:
    i += 1
    runs = [(SampleEntry(SamplingEvent(60000, 0.004), (SumQueryEvent(1.0, 1.0 + k / 100),)),
             1000) for k in range(i)]
    write_ledger_runs(sys.argv[1], runs)
    print(i * 1000, flush=True)
"""

_FSIZE_WRITER = """
import resource, signal, sys, tf_dp
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.ledger_file import write_ledger_runs
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # EFBIG instead of death, as a full disk
path, kind = sys.argv[1], sys.argv[2]
runs = lambda n, off: [(SampleEntry(SamplingEvent(60000, 0.004), (SumQueryEvent(1.0, off + k / 1e4),)), 3)
                       for k in range(n)]
if kind == "ledger":
    write_ledger_runs(path, runs(5, 1.0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        write_ledger_runs(path, runs(2000, 1.0))
        print("ACCEPTED")
    except Exception as e:
        print("ERROR", type(e).__name__, str(e).replace(chr(10), " ")[:300])
else:
    ledger = tf_dp.PrivacyLedger()
    ledger.attach_journal(path)
    ledger.restore_runs(runs(5, 1.0))
    ledger.flush()
    print("DURABLE", ledger.num_samples, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
    try:
        for i in range(3000):
            ledger.record_sampling(60000, 0.004 + i * 1e-6, "poisson")
            ledger.record_sum_query(1.0, 1.1)
            ledger.flush()
            print("DURABLE", ledger.num_samples, flush=True)
        print("ACCEPTED")
    except Exception as e:
        print("ERROR", type(e).__name__, str(e).replace(chr(10), " ")[:300])
"""

_SECOND_WRITER = """
import sys, time, tf_dp
ledger = tf_dp.PrivacyLedger()
try:
    ledger.attach_journal(sys.argv[1])
    print("ATTACHED", flush=True)
    for i in range(50):
        ledger.record_sampling(1000, 0.5, "poisson")
        ledger.record_sum_query(1.0, 9.0)
        ledger.flush()
    print("WROTE", flush=True)
except Exception as e:
    print("ERROR", type(e).__name__, str(e).replace(chr(10), " ")[:300])
"""


def _py(code: str, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, **kw)


def _journal_steps(path: str):
    out = subprocess.run(
        [sys.executable, "-c", "import sys, json; from tf_dp.ledger.journal import "
         "read_journal_runs as r; print(sum(c for _, c in r(sys.argv[1])))", path],
        cwd=ROOT, capture_output=True, text=True)
    return int(out.stdout) if out.returncode == 0 else out.stderr.strip().splitlines()[-1:]


def _file_steps(path: str):
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from tf_dp.ledger import read_ledger_runs as r; "
         "print(sum(c for _, c in r(sys.argv[1])))", path],
        cwd=ROOT, capture_output=True, text=True)
    return int(out.stdout) if out.returncode == 0 else out.stderr.strip().splitlines()[-1:]


def _kill_after(code: str, path: str, seconds: float) -> int:
    """Starts a writer, SIGKILLs it ``seconds`` after its first report; the last count it
    reported durable."""
    p = _py(code, path)
    last = 0
    first = None
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 900  # the writer imports TensorFlow first
    while time.monotonic() < deadline:
        if first is not None and time.monotonic() - first >= seconds:
            break
        if sel.select(0.01):
            line = p.stdout.readline()
            if not line:
                break
            last = int(line)
            first = first or time.monotonic()
    p.kill()
    p.wait()
    return last


def fault_cases(directory: str, kills: int) -> list[dict]:
    import random

    rng = random.Random(0)
    results = []
    for i in range(kills):  # kill during journal appends
        path = os.path.join(directory, f"kill{i}.journal")
        durable = _kill_after(_JOURNAL_WRITER, path, rng.uniform(0.05, 1.5))
        got = _journal_steps(path)
        lost = not isinstance(got, int) or got < durable
        results.append({"id": f"fault:kill_journal_append#{i}", "outcome":
                        "lost" if lost else "kept",
                        "message": f"reported durable {durable}, journal holds {got}"})
    for i in range(max(1, kills // 2)):  # kill during ledger file rewrites
        path = os.path.join(directory, f"kill{i}.ledger.json")
        durable = _kill_after(_FILE_WRITER, path, rng.uniform(0.05, 1.5))
        got = _file_steps(path)
        lost = not isinstance(got, int) or got < durable
        results.append({"id": f"fault:kill_ledger_rewrite#{i}", "outcome":
                        "lost" if lost else "kept",
                        "message": f"last written {durable}, file holds {got}"})
    for kind in ("ledger", "journal"):  # a full disk
        path = os.path.join(directory, f"full.{kind}")
        out = subprocess.run([sys.executable, "-c", _FSIZE_WRITER, path, kind], cwd=ROOT,
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        lines = out.stdout.strip().splitlines()
        durable = max([int(x.split()[1]) for x in lines if x.startswith("DURABLE")] or [15])
        got = _file_steps(path) if kind == "ledger" else _journal_steps(path)
        last = lines[-1] if lines else f"exit {out.returncode}"
        clear = last.startswith("ERROR") and os.path.basename(path) in last
        lost = not isinstance(got, int) or got < durable
        outcome = ("lost" if lost else "kept") + ("" if clear else "+unclear_error")
        results.append({"id": f"fault:full_disk_{kind}", "outcome": outcome,
                        "message": f"{last}; durable {durable}, file holds {got}"})
    # two writers on one journal: the second is refused before it writes
    path = os.path.join(directory, "two.journal")
    first = _py(_SECOND_WRITER.replace("range(50)", "range(20)").replace(
        'print("WROTE", flush=True)', 'print("WROTE", flush=True); time.sleep(3600)'), path)
    first.stdout.readline()  # ATTACHED
    first.stdout.readline()  # WROTE (20 steps), still holding the journal
    second = subprocess.run([sys.executable, "-c", _SECOND_WRITER, path], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    first.kill()
    first.wait()
    got = _journal_steps(path)
    refused = second.stdout.startswith("ERROR") and "two.journal" in second.stdout
    results.append({"id": "fault:two_writers", "outcome":
                    ("kept" if got == 20 else "lost") + ("" if refused else "+not_refused"),
                    "message": f"second: {second.stdout.strip()[:200]}; journal holds {got}"})
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--memory_gb", type=float, default=4.0)
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--only", default="", help="run only the cases whose id starts with this")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.timeout, a.memory_gb)
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        cases = [c for c in input_cases() + file_cases(d) if c["id"].startswith(a.only)]
        results = run_cases(cases, a.timeout, a.memory_gb)
        if "fault:".startswith(a.only) or a.only.startswith("fault:"):
            results += fault_cases(d, a.kills)
    counts: dict = {}
    for r in results:
        group = r["id"].split(":")[0]
        counts.setdefault(group, {}).setdefault(r["outcome"], 0)
        counts[group][r["outcome"]] += 1
    bad = [r for r in results if r["outcome"] not in ("clear", "accepted", "kept")]
    print(f"{len(results)} cases in {time.monotonic() - t0:.0f} s")
    for group, c in counts.items():
        print(f"  {group}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    print(f"defects ({len(bad)}):")
    for r in bad:
        print(f"  {r['outcome']:<8} {r['id']}  {r['message'][:160]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"counts": counts, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
