"""Gradient-mode names -> gradient clippers.

``gradient_mode`` values accepted by the DP optimizers: ``"vectorized"``, ``"microbatch"``,
``"ghost"``, ``"jl"`` and ``"auto"``; :func:`register_gradient_mode` adds a user's own mode.

Example:

>>> from tf_dp.gradients import gradient_modes, make_clipper
>>> gradient_modes()
('auto', 'ghost', 'jl', 'microbatch', 'vectorized')
>>> make_clipper("microbatch", num_microbatches=4).name
'microbatch'
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tf_dp.gradients.base import GradientClipper
from tf_dp.gradients.ghost.clipper import GhostClipper
from tf_dp.gradients.jl import JLClipper
from tf_dp.gradients.microbatch import MicrobatchClipper
from tf_dp.gradients.vectorized import VectorizedClipper


def _jl(
    jl_projections: int = 1, jl_method: str = "auto", seed: Optional[int] = None, **_: Any
) -> JLClipper:
    return JLClipper(jl_projections=jl_projections, method=jl_method, seed=seed)


#: built-in modes whose clipper draws public randomness: ``make_clipper`` hands them ``seed``
_SEEDED = ("microbatch", "jl")

_FACTORIES: dict[str, Callable[..., GradientClipper]] = {
    "vectorized": lambda **_: VectorizedClipper(),
    "microbatch": lambda num_microbatches=1, seed=None, **_: MicrobatchClipper(
        num_microbatches, seed=seed
    ),
    "ghost": lambda **options: GhostClipper(**options),
    "jl": _jl,
}


def register_gradient_mode(name: str, factory: Callable[..., GradientClipper]) -> None:
    """Registers ``factory(**options) -> GradientClipper`` under ``gradient_mode=name`` (the DP
    optimizers pass their ``gradient_mode_options``, and ``jl_projections`` / ``jl_method``)."""
    _FACTORIES[name] = factory


def gradient_modes() -> tuple[str, ...]:
    """The accepted ``gradient_mode`` names (sorted)."""
    return tuple(sorted(set(_FACTORIES) | {"auto"}))


def make_clipper(
    gradient_mode: str,
    model: Optional[Any] = None,
    num_microbatches: Optional[int] = None,
    seed: Optional[int] = None,
    **options: Any,
) -> GradientClipper:
    """Builds the gradient clipper for ``gradient_mode``.

    ``seed`` (tests and debugging; the DP optimizers pass ``noise_seed``) keys the public
    randomness of the ``microbatch`` and ``jl`` clippers (assignment, directions) by the seed
    and the step's number; other modes draw none.

    ``"auto"``: with ``num_microbatches`` set, ``microbatch``. Otherwise ``ghost`` when at least
    one layer holding trainable variables has a ghost norm rule, or when ``tf.vectorized_map``
    cannot take per-example gradients of ``model`` (layers without a rule then get per-example
    gradients of their own variables in the same step: the ghost clipper in mode ``"mixed"``);
    else ``vectorized``. Only trainable variables count: a frozen backbone with LoRA factors or a
    new head is planned from the trainable variables alone.

    Example:

    >>> import keras
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> make_clipper("auto", model=model).description
    'ghost'
    >>> make_clipper("vectorized").name
    'vectorized'
    """
    if gradient_mode == "auto":
        if num_microbatches is not None:
            return MicrobatchClipper(num_microbatches, seed=seed)
        vectorized = VectorizedClipper()
        if model is not None:
            ghost = _FACTORIES["ghost"](**options)
            if ghost.supports(model) is None and (
                ghost.has_rules(model) or vectorized.supports(model) is not None
            ):
                return ghost
        return vectorized
    if gradient_mode == "microbatch":
        if num_microbatches is None:
            raise ValueError("gradient_mode='microbatch' needs num_microbatches (an integer >= 1)")
        return MicrobatchClipper(num_microbatches, seed=seed)
    if gradient_mode == "vectorized":
        if num_microbatches is not None:
            raise ValueError(
                "num_microbatches is only used with gradient_mode='microbatch' or 'auto'"
            )
        return VectorizedClipper()
    if gradient_mode in _FACTORIES:
        if gradient_mode in _SEEDED:
            options["seed"] = seed
        return _FACTORIES[gradient_mode](**options)
    raise ValueError(f"gradient_mode must be one of {gradient_modes()}, got {gradient_mode!r}")
