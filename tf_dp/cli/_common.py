"""Shared helpers for the command-line tools: clean failures (exit status 2, one line)."""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable, Optional, Sequence

from absl import app, flags


class UsageError(Exception):
    """Bad user input: reported as one line on stderr with exit status 2."""


def fail(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parser that turns flag errors into exit status 2 and one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0])
    return []


_HELP_ARGS = ("-h", "-?", "-help", "--help", "--helpshort", "--helpfull")


def help_text(doc: str, flag_names: Sequence[str]) -> str:
    """The tool's docstring followed by every flag it reads: name, meaning, default, choices."""
    lines = [doc.strip(), "", "Flags:"]
    for name in flag_names:
        flag = flags.FLAGS[name]
        text = f"  --{name}: {flag.help}"
        if flag.default is not None:
            text += f" (default: {flag.default})"
        lines.append(text)
    lines.append("  --help: show this help and exit.")
    return "\n".join(lines) + "\n"


def run_main(
    main: Callable[[list[str]], Any], doc: str = "", flag_names: Sequence[str] = ()
) -> None:
    """Runs ``main`` under absl; ``--help`` (or ``-h``) prints ``doc`` and the tool's flags to
    stdout and exits 0."""
    if any(arg in _HELP_ARGS or arg.startswith("--help=") for arg in sys.argv[1:]):
        sys.stdout.write(help_text(doc, flag_names))
        sys.exit(0)

    def wrapped(argv):
        try:
            return main(argv)
        except (UsageError, ValueError) as e:
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
        except (ArithmeticError, RecursionError, MemoryError) as e:
            # A last resort: these inputs are refused earlier with a precise message.
            fail(f"cannot analyse this input ({type(e).__name__}: {e})".splitlines()[0])

    app.run(wrapped, flags_parser=parse_flags)


def define(kind: str, name: str, default, help_text: str, *args) -> None:
    """Defines an absl flag unless a tool imported earlier in this process already did (both tools
    share --N, --batch_size, ... with identical meaning), so importing both never clashes."""
    if name in flags.FLAGS:
        return
    definer = getattr(flags, f"DEFINE_{kind}")
    definer(name, default, *args, help_text)


#: The flags both tools read, in the order ``--help`` lists them.
TRAINING_FLAGS = ("N", "batch_size", "epochs", "steps", "delta", "accountant", "sampling",
                  "max_batch_size", "microbatch_size", "format")


def define_training_flags() -> None:
    """The flags both tools share: the training run's size, sampling and accountant."""
    define("integer", "N", None, "Number of examples in the training set (> 0).")
    define("integer", "batch_size", None,
           "Expected batch size (poisson) or batch size (shuffle), in [1, N].")
    define("float", "epochs", None,
           "Number of epochs (> 0). poisson: ceil(epochs * N / batch_size) steps; shuffle: "
           "ceil(N / batch_size) steps per epoch (the last batch partial, as Keras does), and "
           "exactly ceil(epochs) epochs are counted.")
    define("integer", "steps", None, "Number of steps (> 0; instead of --epochs).")
    define("float", "delta", None, "Target delta, in (0, 1).")
    define("enum", "accountant", "rdp",
           "Accountant (gdp is an approximation; all: every one).",
           ["rdp", "moments", "pld", "gdp", "all"])
    define("enum", "sampling", "poisson",
           "Batch sampling: poisson (amplification applied), shuffle (fixed-size shuffled "
           "batches, no amplification assumed), truncated_poisson (Poisson batches cut at "
           "--max_batch_size) or balls_in_bins (each record in one of ceil(N / batch_size) "
           "batches per epoch; certified as one Gaussian per epoch).",
           ["poisson", "shuffle", "truncated_poisson", "balls_in_bins"])
    define("integer", "max_batch_size", None,
           "truncated_poisson only: the most examples a batch keeps, in [1, N] (default: the "
           "smallest B with P[Binomial(N, batch_size / N) > B] <= 1e-6, as "
           "tf_dp.data.truncated_poisson_batches chooses).")
    define("integer", "microbatch_size", None,
           "Examples per microbatch (> 1: sensitivity 2C, effective noise halved).")
    define("enum", "format", "text", "Output format.", ["text", "json"])


def to_json(obj: Any) -> str:
    """Standard JSON; a float that JSON cannot hold is written as the string ``"Infinity"``,
    ``"-Infinity"`` or ``"NaN"`` (``float()`` in Python and ``Number()`` in JavaScript read them
    back), so an infinite epsilon is never confused with ``null`` (a value not computed).

    Example::

        to_json({"epsilon": math.inf})   # '{\n  "epsilon": "Infinity"\n}'
    """

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(obj), indent=2, allow_nan=False)


def require(flag: str, value) -> None:
    """Raises UsageError naming ``--flag`` when it was not given (None)."""
    if value is None:
        raise UsageError(f"--{flag} is required")


def max_batch_size(sampling: str, n: int, batch_size: int, given: Optional[int]) -> Optional[int]:
    """``--max_batch_size`` checked against ``--sampling`` (truncated Poisson's default ``B``
    when not given)."""
    if sampling != "truncated_poisson":
        if given is not None:
            raise UsageError(f"--max_batch_size applies only to --sampling=truncated_poisson, "
                             f"got --sampling={sampling}")
        return None
    if given is None:
        from tf_dp.data.truncated_poisson import default_truncation_size

        return default_truncation_size(n, batch_size / n)
    if not 1 <= given <= n:
        raise UsageError(f"--max_batch_size must be an integer in [1, --N={n}], got {given}")
    return given


def check_sizes(n, batch_size, steps, epochs, delta) -> None:
    require("N", n)
    require("batch_size", batch_size)
    if steps is None and epochs is None:
        raise UsageError("one of --epochs or --steps is required")
    require("delta", delta)
    if n <= 0:
        raise UsageError(f"--N must be a positive integer, got {n}")
    if batch_size is None or batch_size <= 0:
        raise UsageError(f"--batch_size must be a positive integer, got {batch_size}")
    if batch_size > n:
        raise UsageError(f"--batch_size ({batch_size}) must be <= --N ({n})")
    if (steps is None) == (epochs is None):
        raise UsageError("give exactly one of --epochs or --steps")
    from tf_dp.accounting.ledger_analysis import MAX_STEPS

    if steps is not None and not 0 < steps <= MAX_STEPS:
        raise UsageError(f"--steps must be an integer in [1, {MAX_STEPS:.0e}], got {steps}")
    # Every run is composed at once (never listed step by step), up to MAX_STEPS steps.
    max_epochs = MAX_STEPS / math.ceil(n / batch_size)
    if epochs is not None and not (0 < epochs <= max_epochs):
        raise UsageError(f"--epochs must be in (0, {max_epochs:.4g}] for --N={n} and "
                         f"--batch_size={batch_size} (at most {MAX_STEPS:.0e} steps), got {epochs}")
    if delta is None or not (0.0 < delta < 1.0):
        raise UsageError(f"--delta must be in (0, 1), got {delta}")
