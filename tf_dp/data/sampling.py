"""The sampling claim of a DP run: who was sampled, how, at what rate, and who vouches for it.

A :class:`Sampling` is the one object that says how the batches of a DP run are drawn. It is what
the ledger records at every step (population, rate, policy, pass boundaries) and it gives the
public denominator of the noised mean. A data source of tf_dp (:func:`tf_dp.data.poisson_batches`
and the other samplers of :mod:`tf_dp.data`) hands over its own ``Sampling`` with
``origin="sampled"``: tf_dp drew the batches, so the claim holds by construction. Any other input
needs a ``Sampling`` declared by the user (``origin="declared"``): tf_dp records it as declared and
cannot check it, and every statement built from such a ledger says so.

Example:

>>> from tf_dp.data.sampling import Sampling
>>> s = Sampling(population_size=60_000, selection_probability=256 / 60_000)
>>> s.policy, s.origin, s.unit
('poisson', 'declared', 'example')
>>> round(s.expected_batch_size, 6)
256.0
>>> Sampling(1000, 0.01, unit="user", records_per_unit=4).describe()
'Poisson sampling of users (n=1000, q=0.01, at most 4 records per user), declared, not checked'
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

#: Largest population a sampling may claim: the ledger holds it exactly as a float64
#: (``tf_dp.ledger.events.MAX_COUNT``).
MAX_COUNT = 2**53

#: How batches are drawn: ``poisson`` (each unit independently with probability q at every step),
#: ``shuffle`` (fixed-size batches of a shuffled pass, every unit once per pass),
#: ``truncated_poisson`` (a Poisson sample cut to at most ``max_batch_size`` units,
#: :func:`tf_dp.data.truncated_poisson_batches`) or ``balls_in_bins`` (every pass throws each unit
#: into one of ``round(1 / q)`` batches uniformly at random,
#: :func:`tf_dp.data.balls_in_bins_batches`).
#: ``cyclic_poisson``: the units split into ``num_parts`` fixed parts, step ``t`` a Poisson sample
#: (rate ``q``) of part ``t mod num_parts`` (:func:`tf_dp.data.cyclic_poisson_batches`).
POLICIES = ("poisson", "shuffle", "truncated_poisson", "balls_in_bins", "cyclic_poisson")
#: Who performed the sampling: ``sampled`` (a tf_dp sampler drew the batches) or ``declared``
#: (the user said so; tf_dp records the claim without being able to check it).
ORIGINS = ("sampled", "declared")
#: What one unit of privacy is: one ``example`` (record) or one ``user`` (all of a user's records).
UNITS = ("example", "user")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a DP run draws its batches (immutable).

    Attributes:
      population_size: ``n``, the number of units (records, or users when ``unit="user"``) the
        batches are drawn from; an integer >= 1.
      selection_probability: ``q`` in (0, 1]: for ``poisson`` the per-unit inclusion probability
        of every step, for ``shuffle`` the batch size divided by ``n``.
      policy: one of :data:`POLICIES`.
      origin: one of :data:`ORIGINS`; ``sampled`` only for tf_dp's own samplers.
      unit: one of :data:`UNITS`. Under ``user``, neighbouring data sets differ in all the records
        of one user, and each sampled user contributes at most ``records_per_unit`` records.
      records_per_unit: ``k`` >= 1, the most records a sampled user contributes to one batch
        (required with ``unit="user"``, None with ``unit="example"``).
      max_batch_size: ``B`` >= 1, the most units a ``truncated_poisson`` batch keeps (required
        with that policy, None with the others).
      num_parts: ``b`` >= 1, the parts of ``cyclic_poisson`` (required with that policy, None with
        the others); ``q`` is then the rate within the part drawn from.
    """

    population_size: int
    selection_probability: float
    policy: str = "poisson"
    origin: str = "declared"
    unit: str = "example"
    records_per_unit: Optional[int] = None
    max_batch_size: Optional[int] = None
    num_parts: Optional[int] = None

    def __post_init__(self):
        n = self.population_size
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_COUNT:
            shown = n if not isinstance(n, int) or abs(n) < 10**20 else f"about {float(n):.3g}"
            raise ValueError(
                f"population_size must be an integer >= 1 and <= 2**53 (what the ledger holds "
                f"exactly), got {shown!r}"
            )
        q = self.selection_probability
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not (
            math.isfinite(q) and 0.0 < q <= 1.0
        ):
            raise ValueError(f"selection_probability must be in (0, 1], got {q!r}")
        object.__setattr__(self, "selection_probability", float(q))
        for name, value, allowed in (
            ("policy", self.policy, POLICIES),
            ("origin", self.origin, ORIGINS),
            ("unit", self.unit, UNITS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        k = self.records_per_unit
        if self.unit == "user":
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(
                    f"records_per_unit must be an integer >= 1 with unit='user', got {k!r}"
                )
        elif k is not None:
            raise ValueError(f"records_per_unit must be None with unit='example', got {k!r}")
        b = self.max_batch_size
        if self.policy == "truncated_poisson":
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(
                    f"max_batch_size must be an integer >= 1 with policy='truncated_poisson', "
                    f"got {b!r}"
                )
        elif b is not None:
            raise ValueError(
                f"max_batch_size must be None unless policy='truncated_poisson', got {b!r}"
            )
        parts = self.num_parts
        if self.policy == "cyclic_poisson":
            if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= n:
                raise ValueError(
                    "num_parts must be an integer in [1, population_size] with "
                    f"policy='cyclic_poisson', got {parts!r}"
                )
        elif parts is not None:
            raise ValueError(f"num_parts must be None unless policy='cyclic_poisson', got {parts!r}")

    @property
    def expected_batch_size(self) -> float:
        """``q * n``: the expected number of units per batch (public); ``q * n / num_parts``
        for ``cyclic_poisson`` (a part's share)."""
        if self.policy == "cyclic_poisson":
            return self.selection_probability * self.population_size / self.num_parts
        return self.selection_probability * self.population_size

    @property
    def checked(self) -> bool:
        """Whether tf_dp performed the sampling itself (the claim holds by construction)."""
        return self.origin == "sampled"

    def describe(self) -> str:
        """One line for privacy statements, naming the unit and whether the claim is checked."""
        kind = {
            "poisson": "Poisson sampling",
            "shuffle": "shuffled fixed-size batches",
            "truncated_poisson": f"Poisson sampling truncated at {self.max_batch_size}",
            "balls_in_bins": "balls-in-bins batches",
            "cyclic_poisson": f"cyclic Poisson sampling of {self.num_parts} parts",
        }[self.policy]
        units = "users" if self.unit == "user" else "examples"
        extra = (
            f", at most {self.records_per_unit} records per user" if self.unit == "user" else ""
        )
        who = "sampled by tf_dp" if self.checked else "declared, not checked"
        return (
            f"{kind} of {units} (n={self.population_size}, q={self.selection_probability:g}"
            f"{extra}), {who}"
        )
