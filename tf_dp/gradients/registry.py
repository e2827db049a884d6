"""Gradient-mode names -> strategies.

``gradient_mode`` values accepted by the DP optimizers: ``"vectorized"``, ``"microbatch"`` and
``"auto"`` here; other modules register more (``"ghost"``, ``"jl"``) with
:func:`register_gradient_mode`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tf_dp.gradients.base import GradientStrategy
from tf_dp.gradients.microbatch import MicrobatchStrategy
from tf_dp.gradients.vectorized import VectorizedStrategy

_FACTORIES: dict[str, Callable[..., GradientStrategy]] = {}


def register_gradient_mode(name: str, factory: Callable[..., GradientStrategy]) -> None:
    """Registers ``factory(**options) -> GradientStrategy`` under ``gradient_mode=name``."""
    _FACTORIES[name] = factory


def gradient_modes() -> tuple[str, ...]:
    _load_optional()
    return tuple(sorted(set(_FACTORIES) | {"auto"}))


def _load_optional() -> None:
    # Modules that register extra modes when they exist.
    import importlib

    for mod in ("tf_dp.gradients.ghost", "tf_dp.gradients.jl"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def make_strategy(
    gradient_mode: str,
    model: Optional[Any] = None,
    num_microbatches: Optional[int] = None,
    **options: Any,
) -> GradientStrategy:
    """Builds the strategy for ``gradient_mode``.

    ``"auto"``: with ``num_microbatches`` set, ``microbatch``. Otherwise ``ghost`` when at least
    one layer holding trainable variables has a ghost norm rule, or when ``tf.vectorized_map``
    cannot take per-example gradients of ``model`` (layers without a rule then get per-example
    gradients of their own variables in the same step: ``ghost`` strategy in mode ``"mixed"``);
    else ``vectorized``. Only trainable variables count: a frozen backbone with LoRA factors or a
    new head is planned from the trainable variables alone.

    Example::

        strategy = make_strategy("auto", model=model)
        strategy.description   # e.g. "ghost" (ghost strategy) -- see GhostStrategy
    """
    _load_optional()
    if gradient_mode == "auto":
        if num_microbatches is not None:
            return MicrobatchStrategy(num_microbatches)
        vectorized = VectorizedStrategy()
        if "ghost" in _FACTORIES and model is not None:
            ghost = _FACTORIES["ghost"](**options)
            if ghost.supports(model) is None and (
                ghost.has_rules(model) or vectorized.supports(model) is not None
            ):
                return ghost
        return vectorized
    if gradient_mode == "microbatch":
        if num_microbatches is None:
            raise ValueError("gradient_mode='microbatch' needs num_microbatches (an integer >= 1)")
        return MicrobatchStrategy(num_microbatches)
    if gradient_mode == "vectorized":
        if num_microbatches is not None:
            raise ValueError(
                "num_microbatches is only used with gradient_mode='microbatch' or 'auto'"
            )
        return VectorizedStrategy()
    if gradient_mode in _FACTORIES:
        return _FACTORIES[gradient_mode](**options)
    raise ValueError(f"gradient_mode must be one of {gradient_modes()}, got {gradient_mode!r}")


register_gradient_mode("vectorized", lambda **_: VectorizedStrategy())
register_gradient_mode("microbatch", lambda num_microbatches=1, **_: MicrobatchStrategy(num_microbatches))
