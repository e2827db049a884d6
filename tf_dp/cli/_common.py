"""Shared helpers for the command-line tools: clean failures (exit status 2, one line)."""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable

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


def run_main(main: Callable[[list[str]], Any]) -> None:
    def wrapped(argv):
        try:
            return main(argv)
        except (UsageError, ValueError) as e:
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

    app.run(wrapped, flags_parser=parse_flags)


def define(kind: str, name: str, default, help_text: str, *args) -> None:
    """Defines an absl flag unless a tool imported earlier in this process already did (both tools
    share --N, --batch_size, ... with identical meaning), so importing both never clashes."""
    if name in flags.FLAGS:
        return
    definer = getattr(flags, f"DEFINE_{kind}")
    definer(name, default, *args, help_text)


def define_training_flags() -> None:
    """The flags both tools share: the training run's size, sampling and accountant."""
    define("integer", "N", None, "Number of examples in the training set.")
    define("integer", "batch_size", None, "Expected batch size (Poisson) or batch size (shuffle).")
    define("float", "epochs", None, "Number of epochs (steps = ceil(epochs * N / batch_size)).")
    define("integer", "steps", None, "Number of steps (alternative to --epochs).")
    define("float", "delta", None, "Target delta, in (0, 1).")
    define("enum", "accountant", "rdp", "Accountant.", ["rdp", "moments", "pld", "gdp", "all"])
    define("enum", "sampling", "poisson", "Batch sampling policy.", ["poisson", "shuffle"])
    define("integer", "microbatch_size", None, "Examples per microbatch (>1: sensitivity 2C).")
    define("enum", "format", "text", "Output format.", ["text", "json"])


def to_json(obj: Any) -> str:
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return json.dumps(clean(obj), indent=2, allow_nan=False)


def check_sizes(n, batch_size, steps, epochs, delta) -> None:
    if n is None or n <= 0:
        raise UsageError(f"--N must be a positive integer, got {n}")
    if batch_size is None or batch_size <= 0:
        raise UsageError(f"--batch_size must be a positive integer, got {batch_size}")
    if batch_size > n:
        raise UsageError(f"--batch_size ({batch_size}) must be <= --N ({n})")
    if (steps is None) == (epochs is None):
        raise UsageError("give exactly one of --epochs or --steps")
    if steps is not None and steps <= 0:
        raise UsageError(f"--steps must be a positive integer, got {steps}")
    if epochs is not None and not (epochs > 0 and math.isfinite(epochs)):
        raise UsageError(f"--epochs must be > 0, got {epochs}")
    if delta is None or not (0.0 < delta < 1.0):
        raise UsageError(f"--delta must be in (0, 1), got {delta}")
