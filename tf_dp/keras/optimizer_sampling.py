"""What a DP optimizer is told between steps: how batches are drawn, where passes start, and
the flush after a compiled call.

:class:`OptimizerSampling` is a base class of every DP optimizer
(:class:`tf_dp.keras.optimizers.DPOptimizerMixin`); it forwards the sampling declaration
(:class:`tf_dp.data.Sampling`) to the optimizer's engine, which records it in the ledger with
every step.

Example::

    opt.set_sampling(tf_dp.data.Sampling(60_000, 256 / 60_000))
    opt.start_pass()
    ...                                  # DP steps (a compiled function)
    opt.after_compiled_call()            # staged steps into the ledger
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from tf_dp.data.sampling import Sampling


__all__ = ["OptimizerSampling"]


class OptimizerSampling:
    """Sampling declarations, passes and flushes of a DP optimizer (a base of
    ``DPOptimizerMixin``; it reads the optimizer's engine)."""

    _declaring_from_fit = False  # True while fit declares the sampling of its own input

    def set_sampling(
        self,
        population_size: Union[int, Sampling],
        selection_probability: Optional[float] = None,
        sampling_policy: str = "poisson",
    ) -> None:
        """Declares how batches are drawn (recorded in the ledger from the next step on): a
        :class:`tf_dp.data.Sampling`, or ``(population_size, selection_probability,
        sampling_policy)``.

        ``model.fit`` of a private model sets this itself for in-memory arrays (``shuffle``) and
        for tf_dp's samplers (:func:`tf_dp.data.poisson_batches`, example- or user-level, and the
        others of :mod:`tf_dp.data`); call it yourself for other inputs. A sampling declared here
        is recorded as ``declared`` (tf_dp cannot check it), whatever its ``origin`` says.

        Example::

            opt.set_sampling(tf_dp.data.Sampling(60_000, 256 / 60_000))
            opt.set_sampling(tf_dp.data.Sampling(5_000, 0.02, unit="user", records_per_unit=4))
        """
        if isinstance(population_size, Sampling):
            if selection_probability is not None:
                raise TypeError("pass a Sampling alone, or (population_size, selection_probability)")
            sampling = population_size
        else:
            sampling = _declared(population_size, selection_probability, sampling_policy)
        if not self._declaring_from_fit:
            sampling = dataclasses.replace(sampling, origin="declared")
        self._engine.set_sampling(sampling)  # type: ignore[attr-defined]
        self._sampling_from_fit = self._declaring_from_fit

    @property
    def records_per_user(self) -> Optional[int]:
        """``k`` when the sampling in force is user-level (each user's records clipped together),
        else None."""
        sampling = self._engine.sampling  # type: ignore[attr-defined]
        return sampling.records_per_unit if sampling is not None and sampling.unit == "user" else None

    @property
    def sampling(self) -> Optional[Sampling]:
        """The declared :class:`~tf_dp.engine.Sampling` (None before any declaration)."""
        return self._engine.sampling  # type: ignore[attr-defined]

    @property
    def sampling_configured(self) -> bool:
        return self._engine.sampling is not None  # type: ignore[attr-defined]

    def start_pass(self) -> None:
        """Marks the next DP step as the first of a new pass over the data (eager).

        ``fit`` calls it at the start of every epoch and ``train_on_batch`` before every call;
        call it yourself in a custom loop wherever the loop starts a new pass over its data.
        """
        self._engine.start_pass()  # type: ignore[attr-defined]

    def declare_fit_sampling(self, sampling: Sampling) -> None:
        """A sampling ``fit`` derived from its own input (tf_dp drew or batched the data itself:
        recorded with the sampling's own ``origin``): valid until :meth:`end_fit`."""
        self._declaring_from_fit = True
        try:  # through set_sampling, so that subclasses' checks (DP-FTRL's policy) apply
            self.set_sampling(sampling)
        finally:
            self._declaring_from_fit = False

    def end_fit(self) -> None:
        """Called when a ``fit`` returns: forgets the sampling that ``fit`` derived from its input
        (a later ``fit`` on another input must declare its own) and reports withheld steps."""
        if self._sampling_from_fit:
            self._engine.sampling = None  # type: ignore[attr-defined]
            self._sampling_from_fit = False
        self.after_compiled_call()

    def after_compiled_call(self, counters: Any = None) -> None:
        """Flushes the ledger's staging table and logs DP steps withheld as non-finite (eager);
        raises if a compiled step met a non-finite clip or noise (it recorded nothing).
        ``counters``: the flush's counters as read in the graph that ran the step
        (:meth:`tf_dp.engine.DPEngine.after_step_in_graph`), if it read them."""
        self._engine.flush(counters)  # type: ignore[attr-defined]

    @property
    def skipped_steps(self) -> int:
        """DP steps whose noised update was not finite: withheld, but recorded in the ledger."""
        return self._engine.skipped_steps  # type: ignore[attr-defined]

    def next_sample_entry(self, steps_ahead: int = 0):
        """The :class:`~tf_dp.ledger.events.SampleEntry` the next DP step (``iterations``, or
        ``steps_ahead`` steps after it) will record; :class:`tf_dp.keras.PrivacyBudget` uses it
        to stop before a step that would overspend."""
        return self._engine.next_sample_entry(  # type: ignore[attr-defined]
            int(self.iterations.numpy()), steps_ahead  # type: ignore[attr-defined]
        )

    def next_sample_entries(self, count: int) -> list:
        """The entries of the next ``count`` DP steps (``iterations`` on), in one call: the
        schedules evaluated in numpy where they can be (see
        :meth:`tf_dp.engine.DPEngine.next_sample_entries`), each entry what
        :meth:`next_sample_entry` gives for its step.

        Example::

            upcoming = opt.next_sample_entries(64)   # upcoming[i] == opt.next_sample_entry(i)
        """
        return self._engine.next_sample_entries(  # type: ignore[attr-defined]
            int(self.iterations.numpy()), count  # type: ignore[attr-defined]
        )


def _declared(population_size: Any, selection_probability: Any, policy: str) -> Sampling:
    """The 3-argument declaration as a :class:`Sampling` (a numeric scalar of any type for the
    rate; the messages name the argument: ``Sampling`` checks the population and the rate's
    range, the ledger's ``policy_code`` the policy)."""
    from tf_dp.dp_query.validation import check_scalar
    from tf_dp.ledger.privacy_ledger import policy_code

    q = check_scalar("selection_probability", selection_probability, allow_zero=False)
    policy_code(policy)
    return Sampling(population_size, float(q), policy=policy)
