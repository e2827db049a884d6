"""Audit report files: the summary of an :class:`~tf_dp.auditing.AuditReport` as JSON.

``AuditReport.save(path)`` writes one; :func:`read_report_file` reads and checks it (the
``compute_dp_sgd_privacy --audit_report=PATH`` command prints it beside the ledger analysis). The
file holds the figures, not the canaries' scores. Infinite values are written as ``"Infinity"``.

Example::

    report.save("audit.json")
    summary = read_report_file("audit.json")
    summary["lower_bound"], summary["delta"]
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["KIND", "read_report_file", "write_report_file"]

KIND = "tf_dp.auditing.AuditReport"
_NUMBERS = ("lower_bound", "delta", "confidence", "certified_epsilon")


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and math.isinf(obj):
        return "Infinity" if obj > 0 else "-Infinity"
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_report_file(path: str, summary: dict) -> None:
    """Writes ``summary`` (a dict of JSON values; ``inf`` allowed) with ``"kind": KIND``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_clean({"kind": KIND, **summary}), f, indent=2, allow_nan=False)
        f.write("\n")


def read_report_file(path: str) -> dict:
    """The summary written by ``AuditReport.save``; ``ValueError`` naming the file if it is not one.

    Example::

        summary = read_report_file("audit.json")
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        # ValueError: bad JSON or bytes that are not UTF-8 (UnicodeDecodeError);
        # RecursionError: JSON nested too deep for the parser
        reason = "nested too deep" if isinstance(e, RecursionError) else str(e)
        raise ValueError(f"audit report {path}: cannot read it as JSON ({reason})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ValueError(f"audit report {path}: not a file written by AuditReport.save "
                         f"(no \"kind\": \"{KIND}\")")
    for key in _NUMBERS:
        value = data.get(key)
        if value in ("Infinity", "-Infinity"):
            value = data[key] = float(value.replace("Infinity", "inf"))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"audit report {path}: {key!r} must be a number, got {value!r}")
    if not (0.0 <= data["delta"] < 1.0 and 0.0 < data["confidence"] < 1.0
            and data["lower_bound"] >= 0.0):
        raise ValueError(f"audit report {path}: delta must be in [0, 1), confidence in (0, 1) and "
                         "lower_bound >= 0")
    return data
