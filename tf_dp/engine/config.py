"""The DP step's configuration: privacy parameters apart from the speed-only knobs.

:class:`PrivacyConfig` holds what the guarantee depends on (clip or clip schedule, noise
multiplier or stddev or their schedules, an explicit query, the noise mode, microbatches: they set
the sensitivity). :class:`SpeedConfig` holds what only changes how fast the same clipped sum is
computed (gradient mode, physical batch size, JL options). Both are frozen and validated once,
when built, by :mod:`tf_dp.engine.validation`: a bad value fails there, before anything runs.

Example:

>>> from tf_dp.engine import PrivacyConfig, SpeedConfig
>>> privacy = PrivacyConfig(l2_norm_clip=1.0, noise_multiplier=1.1)
>>> privacy.noise_stddev_value
1.1
>>> SpeedConfig(gradient_mode="ghost").gradient_mode
'ghost'
>>> PrivacyConfig(l2_norm_clip=1.0)
Traceback (most recent call last):
...
ValueError: pass exactly one of noise_multiplier (noise stddev relative to the clip: noise_multiplier * l2_norm_clip) and noise_stddev (absolute noise stddev); got neither
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tf_dp.dp_query.dp_query import DPQuery
from tf_dp.dp_query.noise import check_noise_mode
from tf_dp.engine import validation


@dataclasses.dataclass(frozen=True)
class PrivacyConfig:
    """The privacy parameters of a DP step (immutable; validated when built).

    Attributes:
      l2_norm_clip: per-example L2 clip ``C`` (finite, > 0) or a schedule ``step -> C_t``.
      noise_multiplier: ``z``, noise stddev ``z * C_t`` (finite, >= 0; or a schedule).
      noise_stddev: instead of ``noise_multiplier``: the absolute stddev (or a schedule).
      query: an explicit :class:`tf_dp.dp_query.DPQuery` instead of clip and noise.
      noise_mode: None (``'continuous'``), ``'continuous'`` or ``'grid'`` (built queries only).
      num_microbatches: None (per-example clipping) or the number of microbatches.
      noise_seed: tests and debugging only (a known seed voids the guarantee). Seeds the noise
        and the public randomness of the gradient modes (microbatch assignment, JL directions,
        keyed by the seed and the step), so that a run repeats bit for bit in another process.
      sparse_embeddings: None, or a
        :class:`~tf_dp.dp_query.partition_selection.SparseEmbeddingConfig`: the model's
        embedding tables get DP-AdaFEST updates (noise on privately selected rows only, a
        ``tf.IndexedSlices``), the selection recorded as a second sum query of every step.
    """

    l2_norm_clip: Any = None
    noise_multiplier: Any = None
    noise_stddev: Any = None
    query: Optional[DPQuery] = None
    noise_mode: Optional[str] = None
    num_microbatches: Optional[int] = None
    noise_seed: Optional[int] = None
    sparse_embeddings: Any = None

    def __post_init__(self):
        clip, z, std = (
            validation.python_number(v)
            for v in (self.l2_norm_clip, self.noise_multiplier, self.noise_stddev)
        )
        if self.noise_mode is not None:
            check_noise_mode(self.noise_mode)
            if self.query is not None:
                raise ValueError(
                    "noise_mode applies to the query the optimizer builds from l2_norm_clip; "
                    "with dp_sum_query, pass noise_mode to the query instead"
                )
        if self.query is None:
            validation.check_clip_and_noise(clip, z, std)
        else:
            if clip is not None or z is not None or std is not None:
                raise ValueError(
                    "pass either dp_sum_query or (l2_norm_clip, noise_multiplier or "
                    "noise_stddev), not both"
                )
            if not isinstance(self.query, DPQuery):
                raise TypeError(
                    f"dp_sum_query must be a tf_dp DPQuery, got {type(self.query).__name__}"
                )
        validation.check_count("num_microbatches", self.num_microbatches)
        validation.check_seed("noise_seed", self.noise_seed)
        if self.noise_seed is not None:
            object.__setattr__(self, "noise_seed", int(self.noise_seed))
        for name, value in (("l2_norm_clip", clip), ("noise_multiplier", z), ("noise_stddev", std)):
            object.__setattr__(self, name, validation.number_or_schedule(value))
        if self.sparse_embeddings is not None:
            _check_sparse(self)

    @property
    def has_schedules(self) -> bool:
        """Whether the clip or the noise is a schedule (values set at every step)."""
        return self.query is None and any(
            validation.is_schedule(v)
            for v in (self.l2_norm_clip, self.noise_multiplier, self.noise_stddev)
        )

    @property
    def noise_name(self) -> str:
        """The noise argument given: ``'noise_multiplier'`` or ``'noise_stddev'``."""
        return "noise_multiplier" if self.noise_stddev is None else "noise_stddev"

    @property
    def noise_stddev_value(self) -> Optional[float]:
        """The noise stddev for fixed clip and noise (``z * C`` or ``noise_stddev``), else None."""
        if self.query is not None or self.has_schedules:
            return None
        if self.noise_stddev is not None:
            return float(self.noise_stddev)
        return float(self.noise_multiplier) * float(self.l2_norm_clip)


@dataclasses.dataclass(frozen=True)
class SpeedConfig:
    """How the clipped sum is computed; never changes the guarantee (immutable; validated).

    Attributes:
      gradient_mode: a registered mode (``tf_dp.gradients.gradient_modes()``), default ``'auto'``.
      max_physical_batch_size: None, or clip each sampled batch in pieces of at most this many
        examples (same clipped sum, noise and ledger entry; bounded memory).
      jl_projections: the JL dimension with ``gradient_mode='jl'``.
      jl_method: ``'auto'``, ``'forward'`` or ``'double_vjp'`` with ``gradient_mode='jl'``.
    """

    gradient_mode: str = "auto"
    max_physical_batch_size: Optional[int] = None
    jl_projections: Optional[int] = None
    jl_method: str = "auto"

    def __post_init__(self):
        from tf_dp.gradients import gradient_modes
        from tf_dp.gradients.jl import METHODS
        from tf_dp.gradients.physical_batches import check_max_physical_batch_size

        validation.check_gradient_options(
            self.gradient_mode, gradient_modes(), self.jl_projections, self.jl_method, METHODS
        )
        object.__setattr__(
            self, "max_physical_batch_size",
            check_max_physical_batch_size(self.max_physical_batch_size),
        )


def _check_sparse(privacy: PrivacyConfig) -> None:
    """``sparse_embeddings`` runs with a fixed clip and noise on the built Gaussian query."""
    from tf_dp.dp_query.partition_selection import SparseEmbeddingConfig

    if not isinstance(privacy.sparse_embeddings, SparseEmbeddingConfig):
        raise TypeError(
            "sparse_embeddings must be None or a tf_dp.keras.SparseEmbeddingConfig, got "
            f"{type(privacy.sparse_embeddings).__name__}")
    refused = [
        ("dp_sum_query", privacy.query is not None),
        ("a clip or noise schedule", privacy.has_schedules),
        ("num_microbatches", privacy.num_microbatches is not None),
        ("noise_mode='grid'", privacy.noise_mode == "grid"),
    ]
    for name, given in refused:
        if given:
            raise ValueError(
                f"sparse_embeddings is not supported with {name}: it needs a fixed l2_norm_clip "
                "and noise_multiplier (or noise_stddev) with per-example clipping")


def check_combination(privacy: PrivacyConfig, speed: SpeedConfig) -> None:
    """The checks that need both halves (microbatches against the gradient mode)."""
    if privacy.sparse_embeddings is not None and (
        speed.gradient_mode not in ("auto", "ghost") or speed.max_physical_batch_size is not None
    ):
        raise ValueError(
            "sparse_embeddings needs gradient_mode='auto' or 'ghost' (the tables' rows come from "
            f"the ghost clipper) and max_physical_batch_size=None; got gradient_mode="
            f"{speed.gradient_mode!r}, max_physical_batch_size={speed.max_physical_batch_size!r}")
    validation.check_microbatch_options(
        speed.gradient_mode, privacy.num_microbatches, speed.max_physical_batch_size
    )
