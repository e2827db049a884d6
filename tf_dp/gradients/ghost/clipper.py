"""The ghost clipper: per-example norms from layer inputs and output gradients, no per-example
gradients, and the clipped sum by book-keeping (no second backward pass).

One step:

1. One forward pass under a ``GradientTape``, with every layer that owns trainable variables
   *recorded*: its ``call`` is temporarily wrapped so that each call's inputs and output are kept
   (for Dense/EinsumDense/Conv the output before the activation).
2. One backward pass for the gradients of the summed per-example losses with respect to the
   recorded outputs only (no parameter gradients).
3. Each covered layer's norm rule turns (inputs, output gradients) into factors of its per-example
   gradients (:mod:`~tf_dp.gradients.ghost.factors`); the factors give per-example, per-variable
   squared norms; the query's clipping rule (``query.clip_weights``) gives per-example weights --
   per variable, so per-layer clipping with a ``NestedQuery`` works -- and the same factors give
   ``sum_b w_b grad_b`` for each variable.
4. Layers without a rule ("mixed" mode) get materialised per-example gradients of their own
   variables, from a ``tf.vectorized_map`` of their own ``call`` on each example's recorded inputs
   with its recorded output gradient (a local vectorized VJP, not a re-run of the model).
   Variables owned by no layer, or by several layers (tied weights), get per-example gradients
   from the vectorized clipper on the whole model.
   Where ``tf.vectorized_map`` is known to crash the process (a model or layer that
   :func:`~tf_dp.gradients.base.vectorized_map_blocker` names: an ``EinsumDense`` with a rank-3
   kernel, e.g. in attention), both fallbacks compute the per-example gradients in a loop over the
   examples instead (exact, slower), and the plan's ``description`` says so.

Every clipped record is exactly the vector whose norm was measured (the same factors give both), so
a rule that missed a use of a variable would bias the gradient but never break the clipping bound.
Uses outside a rule's view are found: the capture watches which variables each recorded call, and
the rest of the forward pass, reads, and a layer whose variable is read outside its own calls
(``ops.matmul(x, self.ffw_linear.kernel)`` in keras-hub's Gemma 4) moves to a fallback
(:func:`_demote_outside_reads`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Optional

import tensorflow as tf

from tf_dp import _compat
from tf_dp.gradients import base
from tf_dp.gradients.ghost import factors as F
from tf_dp.gradients.ghost.registry import RuleEntry
from tf_dp.gradients.ghost.rules import find_rule, is_container
from tf_dp.gradients.vectorized import VectorizedClipper

_logger = logging.getLogger("tf_dp")


def _key(v: Any) -> int:
    return id(base.as_tf_variables([v])[0])


def _writes_trainable_in_forward(layer) -> bool:
    """Keras's ``SpectralNormalization``: in a training call it writes the normalised kernel into
    the kernel of the layer it wraps (and its power-iteration vector), then calls that layer.
    The step's gradients are those at the written kernel only if the forward pass runs once."""
    import keras

    cls = getattr(keras.layers, "SpectralNormalization", None)
    return cls is not None and isinstance(layer, cls) and type(layer).call is cls.call


def _own_trainable(layer) -> list:
    own = _compat.own_trainable_variables(layer)
    if own is None:
        return []
    return list(own)


def _rule_variables(layer, entry) -> list:
    """The trainable variables a rule covers: the layer's own, or ``entry.variables(layer)``."""
    if entry is not None and entry.variables is not None:
        return [v for v in entry.variables(layer) if getattr(v, "trainable", True)]
    return _own_trainable(layer)


def _all_layers(model) -> list:
    layers = _compat.flatten_layers(model) or [model]
    seen, out = set(), []
    for layer in layers:
        if id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)
    return out


@dataclasses.dataclass
class Plan:
    """Which layers the ghost clipper records, and how each variable gets its norms."""

    ghost: list  # [(layer, RuleEntry)]
    local: list  # [(layer, reason, variables)] -- vectorized over the layer's own call
    model_level: list  # variables (keys) for the whole-model vectorized fallback
    model_level_names: list
    #: why the whole-model fallback loops over the examples instead of vectorized_map (or None)
    model_loop: Optional[str] = None
    #: fallback layers (by id) whose local per-example gradients loop: id -> reason
    local_loop: dict = dataclasses.field(default_factory=dict)
    #: layers moved out of their rule (or per-layer fallback) by a traced step, because a call's
    #: output does not have the examples on axis 0: layer name -> where their variables went
    demoted: dict = dataclasses.field(default_factory=dict)
    #: whether a shape probe (:func:`_probe_axis0`) has run for a trace with an unknown batch size
    probed: bool = False
    #: layers (by id) whose outputs had the examples on axis 0 at every probe size
    axis0_ok: set = dataclasses.field(default_factory=set)

    @property
    def mode(self) -> str:
        return "ghost" if not self.local and not self.model_level else "mixed"

    @property
    def description(self) -> str:
        import keras

        # rules that list their variables: recurrent layers (their cell's), other layers over
        # their sublayers' variables, and forward-only rules (no variable: calls rerouted)
        covering = [(layer, entry) for layer, entry in self.ghost if entry.variables is not None]
        kinds = {"recurrent rule": [], "rule over sublayer variables": [],
                 "calls rerouted to sublayer rules": []}
        for layer, entry in covering:
            if not entry.variables(layer):
                kinds["calls rerouted to sublayer rules"].append(layer.name)
            elif isinstance(layer, keras.layers.RNN):
                kinds["recurrent rule"].append(layer.name)
            else:
                kinds["rule over sublayer variables"].append(layer.name)
        notes = [f"{kind}: {', '.join(names)}" for kind, names in kinds.items() if names]
        suffix = f" ({'; '.join(notes)})" if notes else ""
        if self.mode == "ghost":
            return "ghost" + suffix
        parts = [layer.name for layer, _, _ in self.local]
        if self.model_level_names:
            parts.append("model-level variables: " + ", ".join(self.model_level_names))
        loops = [layer.name for layer, _, _ in self.local if id(layer) in self.local_loop]
        if self.model_level_names and self.model_loop is not None:
            loops.append("model-level variables")
        if loops:
            reason = self.model_loop or next(iter(self.local_loop.values()))
            suffix += (
                "; per-example loop, not vectorized_map, for: " + ", ".join(loops) + f" ({reason})"
            )
        if self.demoted:
            suffix += "; " + "; ".join(f"{k}: {v}" for k, v in self.demoted.items())
        return "ghost+vectorized (layers: " + ", ".join(parts) + ")" + suffix


def _parents(model) -> tuple[dict, dict]:
    """``(first parent, all parents)`` of every layer under ``model``, by ``id``."""
    parents: dict[int, Any] = {}
    every: dict[int, list] = {}
    stack, seen = [model], {id(model)}
    while stack:
        layer = stack.pop()
        children = _compat.flatten_layers(layer, include_self=False, recursive=False) or []
        for child in children:
            every.setdefault(id(child), [])
            if all(p is not layer for p in every[id(child)]):
                every[id(child)].append(layer)
            parents.setdefault(id(child), layer)
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return parents, every


def _maybe_tied(layer, every) -> bool:
    """A layer tracked by several parents, one of them an unregistered plain layer: that layer
    may read its variables directly (weight tying) rather than call it. A parent declared a
    container (it only calls its sublayers) does not count."""
    import keras

    ps = every.get(id(layer), [])
    return len(ps) > 1 and any(
        not isinstance(p, keras.Model) and find_rule(p)[0] is None and not is_container(p)
        for p in ps
    )


def _fallback_unit(layer, model, parents):
    """The outermost unregistered, non-Model ancestor of an unregistered layer (e.g. the LSTM or
    Bidirectional around an LSTMCell, whose calls happen inside a loop)."""
    import keras

    unit = layer
    parent = parents.get(id(layer))
    while (
        parent is not None
        and parent is not model
        and not isinstance(parent, keras.Model)
        and find_rule(parent)[0] is None
    ):
        unit = parent
        parent = parents.get(id(parent))
    return unit


def make_plan(model, variables) -> Plan:
    var_keys = {_key(v) for v in variables}
    layers = _all_layers(model)
    parents, every = _parents(model)
    owners: dict[int, list] = {}
    for layer in layers:
        for v in _own_trainable(layer):
            k = _key(v)
            if k in var_keys:
                owners.setdefault(k, [])
                if layer not in owners[k]:
                    owners[k].append(layer)
    ghost, local, model_level, names = [], [], [], []
    # rules that cover their sublayers' variables (a recurrent layer and its cell): the layer is
    # recorded, and the variables are not planned again at their owners
    covered: set = set()
    for layer in layers:
        if layer is model:
            continue
        entry, _ = find_rule(layer)
        if entry is None or entry.variables is None:
            continue
        vs = [v for v in _rule_variables(layer, entry) if _key(v) in var_keys]
        if not vs and entry.forward is not None and not entry.variables(layer):
            # a forward-only rule: it covers no variable but reroutes its layer's calls so that
            # its sublayers' rules see them (keras-hub Gemma 4's feed-forward matmuls)
            ghost.append((layer, entry))
            continue
        if not vs or any(_key(v) in covered for v in vs):
            continue
        if any(len(owners.get(_key(v), [])) > 1 for v in vs):
            continue
        ghost.append((layer, entry))
        covered.update(_key(v) for v in vs)
    units: dict[int, list] = {}  # fallback unit -> [variables]
    for layer in layers:
        own = [v for v in _own_trainable(layer) if _key(v) in var_keys and _key(v) not in covered]
        if not own:
            continue
        tied = [v for v in own if len(owners[_key(v)]) > 1 or _maybe_tied(layer, every)]
        if tied:
            for v in tied:
                if _key(v) not in model_level:
                    model_level.append(_key(v))
                    names.append(getattr(v, "path", None) or v.name)
            continue
        entry, reason = find_rule(layer) if layer is not model else (None, "the model itself")
        if entry is not None and entry.variables is None:
            ghost.append((layer, entry))
            continue
        if entry is not None:  # covers sublayers only; its own remaining variables fall back
            reason = f"{layer.name}: variables outside the rule's coverage"
        unit = layer if layer is model else _fallback_unit(layer, model, parents)
        if id(unit) not in units:
            units[id(unit)] = []
            local.append((unit, reason))
        units[id(unit)].extend(own)
    local = [(unit, reason, units[id(unit)]) for unit, reason in local]
    for v in variables:
        if _key(v) not in owners and _key(v) not in model_level:
            model_level.append(_key(v))
            names.append(getattr(v, "path", None) or v.name)
    local_loop = {}
    for unit, _, _ in local:
        blocker = base.vectorized_map_blocker(unit)
        if blocker is not None:
            local_loop[id(unit)] = blocker
    return Plan(
        ghost, local, model_level, names, base.vectorized_map_blocker(model), local_loop
    )


@dataclasses.dataclass
class _Record:
    layer: Any
    entry: Optional[RuleEntry]
    orig: Any
    args: tuple
    kwargs: dict
    inputs: Any
    outputs: list  # float output leaves (watched)
    #: ids of the recorded layers whose calls were running when this call started (outermost first)
    enclosing: tuple = ()


def _float_leaves(z) -> list:
    return [t for t in tf.nest.flatten(z) if tf.is_tensor(t) and t.dtype.is_floating]


class _ScopeReads:
    """The trainable variables each open scope reads while it is the innermost one (a recorded
    call's own reads, apart from those of the recorded calls it makes), from TensorFlow's
    variable watchers (:func:`tf_dp._compat.variable_watcher`): they see the same accesses a
    ``GradientTape(watch_accessed_variables=True)`` watches, but record no operations. A second
    recording tape beside the clipper's would make TensorFlow build the gradient of control flow
    (a recurrent layer's loop) through a higher-order wrapper: on the reference BiLSTM about
    6 ms more per step (gradient sums and zero fills of the loop's outputs)."""

    def __init__(self):
        self._stack: list = []  # [reads so far, the running watcher or None] per open scope

    def open(self) -> None:
        if self._stack:
            self._pause(self._stack[-1])
        watcher = _compat.variable_watcher()
        watcher.__enter__()
        self._stack.append([set(), watcher])

    def close(self) -> set:
        top = self._stack.pop()
        self._pause(top)
        if self._stack:  # the enclosing scope reads on
            watcher = _compat.variable_watcher()
            watcher.__enter__()
            self._stack[-1][1] = watcher
        return top[0]

    @staticmethod
    def _pause(scope: list) -> None:
        watcher = scope[1]
        if watcher is not None:
            scope[0].update(id(v) for v in watcher.watched_variables())
            watcher.__exit__(None, None, None)
            scope[1] = None


class _Capture:
    """Wraps the ``call`` of the planned layers while active; records each call."""

    def __init__(self, plan: Plan, tape: tf.GradientTape):
        self._plan = plan
        self._tape = tape
        self.records: list[_Record] = []
        self.nested: set = set()
        self._saved: list = []
        self._stack: list = []  # ids of the recorded layers whose calls are running
        #: the variables each scope read directly (not inside a recorded call it made): one
        #: ``(ids of the recorded layers whose calls enclose it, own included; variable keys)``
        #: per recorded call and one for the rest of the forward pass (``()``)
        self.reads: list = []
        self._watch = _ScopeReads()

    def __enter__(self):
        try:
            self._graph = tf.compat.v1.get_default_graph()
        except Exception:  # pragma: no cover
            self._graph = None
        self._watch.open()
        items = [(l, e) for l, e in self._plan.ghost] + [(l, None) for l, _, _ in self._plan.local]
        for layer, entry in items:
            had = "call" in layer.__dict__
            prev = layer.__dict__.get("call")
            orig = layer.call
            object.__setattr__(layer, "call", self._wrap(layer, entry, orig))
            self._saved.append((layer, had, prev))
        return self

    def __exit__(self, *exc):
        self.reads.append(((), self._watch.close()))
        for layer, had, prev in reversed(self._saved):
            if had:
                object.__setattr__(layer, "call", prev)
            else:
                object.__delattr__(layer, "call")
        self._saved = []
        return False

    def _wrap(self, layer, entry, orig):
        try:
            first = next(iter(inspect.signature(orig).parameters))
        except (StopIteration, TypeError, ValueError):
            first = None

        def call(*args, **kwargs):
            inputs = args[0] if args else kwargs.get(first)
            split = entry is not None and entry.split_activation
            act = layer.activation if split else None
            if split:
                object.__setattr__(layer, "activation", None)
            nested = tf.compat.v1.get_default_graph() is not self._graph
            watched: list = []

            def watch(t):
                t = tf.convert_to_tensor(t)
                self._tape.watch(t)
                watched.append(t)
                return t

            enclosing = tuple(self._stack)
            self._stack.append(id(layer))
            if not nested:  # the variables this call reads, apart from its enclosing scopes'
                self._watch.open()
            try:
                if entry is not None and entry.forward is not None and not nested:
                    z, inputs = entry.forward(layer, orig, args, kwargs, watch)
                else:
                    z = orig(*args, **kwargs)
            finally:
                if not nested:
                    self.reads.append((enclosing + (id(layer),), self._watch.close()))
                self._stack.pop()
                if split:
                    object.__setattr__(layer, "activation", act)
            leaves = watched if watched else _float_leaves(z)
            if nested:
                # called inside control flow (a loop body or cond branch): the outer tape cannot
                # give gradients for these tensors; the clipper falls back for this layer
                self.nested.add(id(layer))
                return act(z) if act is not None else z
            self._tape.watch(leaves)
            self.records.append(
                _Record(layer, entry, orig, args, kwargs, inputs, leaves, enclosing)
            )
            return act(z) if act is not None else z

        return call


def _local_per_example(
    rec: _Record, grads: list, variables: list, loop: bool = False, batch: Optional[int] = None
) -> list:
    """Per-example gradients of ``variables`` through one recorded call of its layer alone
    (``loop``: a ``map_fn`` over the examples, never ``vectorized_map``). The call's tensor
    arguments whose axis 0 has the batch's static size ``batch`` (default: the output's) are
    split per example; the others (a constant table, position ids) are passed whole."""
    flat = tf.nest.flatten((rec.args, rec.kwargs))
    if batch is None:
        batch = rec.outputs[0].shape[0] if rec.outputs else None
    slots = [
        i
        for i, t in enumerate(flat)
        if tf.is_tensor(t) and t.shape.rank and t.shape.rank >= 1 and t.shape[0] == batch
    ]
    tf_vars = base.as_tf_variables(variables)
    n = len(slots)

    def one(elems):
        vals = list(flat)
        for j, i in enumerate(slots):
            vals[i] = elems[j][None]
        args, kwargs = tf.nest.pack_sequence_as((rec.args, rec.kwargs), vals)
        with tf.GradientTape() as tape:
            out = _float_leaves(rec.orig(*args, **kwargs))
        gs = tape.gradient(
            out,
            tf_vars,
            output_gradients=[g[None] for g in elems[n:]],
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        return [tf.convert_to_tensor(g) for g in gs]

    elems = [flat[i] for i in slots] + list(grads)
    signature = [tf.TensorSpec(v.shape, tf.float32) for v in tf_vars]
    if loop:  # vectorized_map would crash the process (base.vectorized_map_blocker)
        return tf.map_fn(one, elems, fn_output_signature=signature)
    try:
        return tf.vectorized_map(one, elems, fallback_to_while_loop=True)
    except (TypeError, ValueError, NotImplementedError) as e:  # e.g. Keras RNN loops under pfor
        _logger.info("tf_dp: vectorized_map failed on layer %r (%s); using map_fn", rec.layer.name, e)
        return tf.map_fn(one, elems, fn_output_signature=signature)


def _axis0_is_examples(rec: _Record, n: Optional[int]) -> Optional[bool]:
    """Whether every recorded output of ``rec`` has the examples on axis 0, which every norm
    rule and the per-layer fallback assume. ``False`` when the static shapes say not: axis 0 of
    another size than the batch's ``n`` (tokens flattened to ``[B*T, d]`` before a router or
    an expert bank), or of a fixed size where the batch's is unknown (a ``[1, P, d]`` position
    table broadcast over the batch); ``None`` when they cannot tell (both sizes unknown)."""
    unknown = False
    for t in rec.outputs:
        rank = t.shape.rank
        if rank == 0:
            return False
        d = t.shape[0] if rank is not None else None
        if d is not None and (n is None or d != n):
            return False
        if d is None:
            unknown = True
    return None if unknown else True


def _demote_off_axis(plan: Plan, records: list, n: Optional[int], index: dict) -> list:
    """Moves the layers of ``records`` whose outputs do not have the examples on axis 0 (see
    :func:`_axis0_is_examples`) out of their rule or per-layer fallback, for good (the plan is
    kept for later traces): their variables get per-example gradients from the per-layer fallback
    of the recorded fallback layer whose call encloses every call of theirs (e.g. the decoder block
    around a mixture-of-experts router), or else from the whole-model fallback. Without this the
    rule's norms were per token (``[B*T]``) or per table (``[1]``) and the step failed with an
    ``AddN`` shape mismatch; a wrong grouping could also have mixed examples' contributions.

    Returns the records whose axis 0 the static shapes cannot check (both sizes unknown)."""
    verdict: dict = {}
    unknown = []
    for rec in records:
        ok = _axis0_is_examples(rec, n)
        if ok is None:
            unknown.append(rec)
        if ok is not False:
            verdict.setdefault(id(rec.layer), True)
        else:
            verdict[id(rec.layer)] = False
    bad = [rec.layer for rec in records if verdict.get(id(rec.layer)) is False]
    bad = list({id(layer): layer for layer in bad}.values())
    if not bad:
        return unknown
    bad_ids = {id(layer) for layer in bad}
    for layer in bad:
        # the innermost recorded fallback layer around each call; one for all calls, or none
        sites = {_innermost_unit(plan, rec.enclosing, bad_ids) for rec in records if rec.layer is layer}
        shape = next(
            list(t.shape)
            for rec in records
            if rec.layer is layer
            for t in rec.outputs
            if t.shape.rank == 0 or (t.shape.rank and t.shape[0] is not None and t.shape[0] != n)
        )
        _demote(plan, layer, sites, f"output shape {shape} has no example axis 0 (batch {n})", index)
    return [rec for rec in unknown if id(rec.layer) not in bad_ids]


def _innermost_unit(plan: Plan, enclosing: tuple, exclude: set = frozenset()) -> Optional[int]:
    """The id of the innermost per-layer fallback layer in ``enclosing`` (ids, outermost first),
    or ``None``."""
    units = {id(u) for u, _, _ in plan.local if id(u) not in exclude}
    inner = [i for i in enclosing if i in units]
    return inner[-1] if inner else None


def _demote(plan: Plan, layer, sites: set, why: str, index: dict) -> None:
    """Moves ``layer`` out of its rule or per-layer fallback for good: its variables get
    per-example gradients from the per-layer fallback whose call encloses every use of them
    (``sites``: the innermost fallback layer's id at each use, ``None`` for none), or else from
    the whole-model fallback."""
    entries = {id(l): e for l, e in plan.ghost}
    if id(layer) in entries:
        own = _rule_variables(layer, entries[id(layer)])
    else:
        own = next(vs for u, _, vs in plan.local if u is layer)
    own = [v for v in own if _key(v) in index]
    plan.ghost[:] = [(l, e) for l, e in plan.ghost if l is not layer]
    plan.local[:] = [(u, r, vs) for u, r, vs in plan.local if u is not layer]
    unit_id = next(iter(sites)) if len(sites) == 1 else None
    unit = next((u for u, _, _ in plan.local if id(u) == unit_id), None)
    if unit is not None:
        unit_vs = next(vs for u, _, vs in plan.local if u is unit)
        unit_vs.extend(v for v in own if all(_key(v) != _key(u) for u in unit_vs))
        plan.demoted[layer.name] = f"{why}; per-example gradients through {unit.name}"
    else:
        for v in own:
            if _key(v) not in plan.model_level:
                plan.model_level.append(_key(v))
                plan.model_level_names.append(getattr(v, "path", None) or v.name)
        plan.demoted[layer.name] = f"{why}; per-example gradients through the model"
    _logger.info("tf_dp: ghost clipper: %s: %s", layer.name, plan.demoted[layer.name])


def _demote_outside_reads(plan: Plan, capture: "_Capture", index: dict) -> None:
    """Moves out of its rule (or per-layer fallback) every layer one of whose variables the
    forward pass read outside that layer's own calls, e.g. a decoder block computing
    ``ops.matmul(x, self.ffw_linear.kernel)`` instead of calling ``self.ffw_linear`` (keras-hub's
    Gemma 4). A rule sees only its layer's calls: such a use is missing from the norms and the
    sum (the variable trained on part of its gradient, or not at all). The variables go to the
    per-layer fallback whose call encloses every use (the decoder block), or to the whole-model
    fallback."""
    owner: dict = {}  # variable key -> the rule layer or fallback layer whose norms cover it
    for layer, entry in plan.ghost:
        for v in _rule_variables(layer, entry):
            owner.setdefault(_key(v), layer)
    for unit, _, vs in plan.local:
        for v in vs:
            owner.setdefault(_key(v), unit)
    model_level = set(plan.model_level)
    bad: dict = {}  # id(layer) -> (layer, innermost fallback ids at the outside reads, names)
    for scope, keys in capture.reads:
        for k in keys:
            layer = owner.get(k)
            if layer is None or k in model_level or k not in index or id(layer) in scope:
                continue
            where = bad.setdefault(id(layer), (layer, set(), set()))
            where[1].add(_innermost_unit(plan, scope, {id(layer)}))
            where[2].add(k)
    for layer, sites, keys in bad.values():
        sites = set(sites)
        sites.update(
            _innermost_unit(plan, rec.enclosing, {id(layer)})
            for rec in capture.records
            if rec.layer is layer
        )
        names = sorted(
            getattr(v, "path", None) or v.name
            for l, e in plan.ghost if l is layer for v in _rule_variables(l, e) if _key(v) in keys
        ) or sorted(
            getattr(v, "path", None) or v.name
            for u, _, vs in plan.local if u is layer for v in vs if _key(v) in keys
        )
        _demote(plan, layer, sites, f"{', '.join(names)} read outside the layer's call", index)


#: the batch sizes of the shape probe: a tensor whose axis 0 has each of them is taken as
#: having the examples on axis 0 (a fixed size cannot equal both)
_PROBE_SIZES = (2, 3)


def _probe_axis0(plan: Plan, loss_fn, data, index: dict) -> None:
    """For a step traced with an unknown batch size (``[None, ...]``), where
    :func:`_demote_off_axis` cannot tell tokens flattened to ``[B*T, d]`` from examples: traces
    (never runs) the recorded forward pass with static batch sizes ``_PROBE_SIZES`` and demotes the
    layers whose outputs' axis 0 is not the batch. Tracing only: no op of the probe runs, so no
    random state moves and no variable changes."""
    plan.probed = True
    seen: list = []  # per probe size: the layers whose every output had the batch on axis 0

    def spec(t):
        t = tf.convert_to_tensor(t)
        return tf.TensorSpec([size] + t.shape.as_list()[1:], t.dtype)

    for size in _PROBE_SIZES:

        def forward(x, y, sw):
            with tf.GradientTape() as tape:
                with _Capture(plan, tape) as capture:
                    loss_fn(x, y, sw)
            records = [r for r in capture.records if id(r.layer) not in capture.nested]
            _demote_off_axis(plan, records, size, index)
            _demote_outside_reads(plan, capture, index)
            ok = {id(r.layer) for r in records if _axis0_is_examples(r, size)}
            ok -= {id(r.layer) for r in records if not _axis0_is_examples(r, size)}
            seen.append(ok)
            return tf.constant(0.0)

        x, y, sw = data
        specs = [tf.nest.map_structure(spec, t) if t is not None else None for t in (x, y, sw)]
        try:
            tf.function(forward, autograph=False).get_concrete_function(*specs)
        except Exception as e:  # noqa: BLE001 -- a model that cannot trace at this size
            _logger.info("tf_dp: ghost clipper: shape probe at batch %d failed (%s)", size, e)
            return
    plan.axis0_ok = set.intersection(*seen) if seen else set()


def _whole_model_per_example(loss_fn, data, variables, loop: bool = False) -> list:
    """Per-example gradients of ``variables`` through the whole model (vectorized clipper; a
    sequential ``map_fn`` where ``vectorized_map`` cannot convert the model, or, with ``loop``,
    where it would crash the process)."""
    if not loop:
        try:
            return VectorizedClipper().per_example_gradients(loss_fn, data, variables)[0]
        except (TypeError, ValueError, NotImplementedError) as e:
            _logger.info("tf_dp: vectorized_map failed on the model (%s); using map_fn", e)
    x, y, sw = data
    tf_vars = base.as_tf_variables(variables)

    def one(example):
        ex_x, ex_y, ex_sw = example
        expand = lambda t: tf.nest.map_structure(lambda a: a[None], t)  # noqa: E731
        with tf.GradientTape() as tape:
            loss, _ = loss_fn(expand(ex_x), expand(ex_y), None if sw is None else expand(ex_sw))
            loss = tf.reduce_sum(loss)
        grads = tape.gradient(loss, tf_vars, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in grads]

    elems = (x, y, sw if sw is not None else tf.zeros([base.batch_size_of(x)]))
    signature = [tf.TensorSpec(v.shape, tf.float32) for v in tf_vars]
    return tf.map_fn(one, elems, fn_output_signature=signature)


class GhostClipper(base.GradientClipper):
    """Ghost clipping with a per-layer norm registry and a vectorized fallback.

    ``mode`` is ``"ghost"`` when every trainable variable is covered by a norm rule, ``"mixed"``
    otherwise; ``description`` names the layers that use the fallback. Both are set when the
    clipper meets a model (``supports(model)`` or the first step).

    Example::

        opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                              learning_rate=0.1, gradient_mode="ghost")
        model.fit(...)
        opt.gradient_clipper.description   # "ghost" or "ghost+vectorized (layers: lstm)"
    """

    name = "ghost"

    def __init__(self, **_options: Any):
        #: keys of embedding tables whose clipped sum is returned as ``tf.IndexedSlices`` of the
        #: clipped per-example rows (``values [B*T, d]``, ``indices`` the ids; set by the engine
        #: for ``sparse_embeddings``)
        self.sparse_keys: frozenset = frozenset()
        self._plans: dict = {}
        self._logged: set = set()
        self.mode: Optional[str] = None
        self.description: Optional[str] = None

    def _plan_for(self, model, variables) -> Plan:
        key = (id(model), tuple(_key(v) for v in variables))
        plan = self._plans.get(key)
        if plan is None:
            plan = make_plan(model, variables)
            self._plans[key] = plan
        self.mode, self.description = plan.mode, plan.description
        if key not in self._logged:
            self._logged.add(key)
            _logger.info("tf_dp: ghost clipper for model %r: %s", model.name, plan.description)
        return plan

    def plan(self, model: Any) -> Plan:
        """The plan for ``model``'s trainable variables: the layers each rule records and the
        fallbacks, as refined by the steps traced so far (a layer whose output turned out not to
        have the examples on axis 0 is listed in ``plan.demoted`` with where its variables went).

        Example::

            clipper = opt.gradient_clipper        # after model.fit(...)
            plan = clipper.plan(model)
            plan.mode, [layer.name for layer, _, _ in plan.local], plan.demoted
        """
        return self._plan_for(model, list(model.trainable_variables))

    def supports(self, model: Optional[Any]) -> Optional[str]:
        """``None`` for any built model with trainable variables: variables of layers without a
        norm rule get per-example gradients in the same step (``mode == "mixed"``)."""
        if model is None:
            return "the ghost clipper needs the model"
        if not getattr(model, "built", True) or not model.trainable_variables:
            return "the model is not built (or has no trainable variables)"
        writers = [layer.name for layer in _all_layers(model) if _writes_trainable_in_forward(layer)]
        if writers:
            return (
                f"layer(s) {', '.join(writers)} (SpectralNormalization) write their wrapped "
                "layer's kernel in the forward pass, which the ghost clipper's per-layer and "
                "whole-model fallbacks would run a second time; gradient_mode='vectorized' (what "
                "'auto' picks) runs it once"
            )
        self._plan_for(model, list(model.trainable_variables))
        return None

    def has_rules(self, model: Any) -> bool:
        """True when a norm rule covers at least one of ``model``'s trainable variables."""
        return bool(self._plan_for(model, list(model.trainable_variables)).ghost)

    def __repr__(self) -> str:
        return f"GhostClipper(mode={self.mode!r}, description={self.description!r})"

    needs_model = True

    def clipped_sum(
        self, loss_fn, data, variables, query, params, model=None
    ) -> base.ClippedGradients:
        """The clipped sum; ``model`` is the model whose layers the rules read (without it:
        ``loss_fn.model``, which :class:`tf_dp.keras.PerExampleLoss` has)."""
        return self.grouped_clipped_sum(loss_fn, data, variables, query, params, 1, model=model)

    def grouped_clipped_sum(
        self, loss_fn, data, variables, query, params, group_size: int, model=None
    ) -> base.ClippedGradients:
        """:meth:`clipped_sum` with records ``j k .. j k + k - 1`` (``k = group_size``) clipped
        together: the sum of each group's gradients is one clipped record (user-level clipping,
        :mod:`tf_dp.gradients.per_user`); ``norms`` and ``record_mask`` are then per group."""
        k = int(group_size)
        base.check_weights_structure(query, variables)
        variables = list(variables)
        if model is None:
            model = getattr(loss_fn, "model", None)
        if model is None:
            raise ValueError("the ghost clipper needs the model: pass clipped_sum(..., model=)")
        plan = self._plan_for(model, variables)
        data = base.fill_padding_rows(data)
        x, y, sw = data

        index = {_key(v): i for i, v in enumerate(variables)}
        n = tf.nest.flatten(x)[0].shape[0]
        demoted = len(plan.demoted)
        if n is None and not plan.probed:
            _probe_axis0(plan, loss_fn, data, index)
        with tf.GradientTape() as tape:
            with _Capture(plan, tape) as capture:
                losses, y_pred = loss_fn(x, y, sw)
            total = tf.reduce_sum(losses)
        records = [r for r in capture.records if id(r.layer) not in capture.nested]
        unchecked = _demote_off_axis(plan, records, n, index)
        _demote_outside_reads(plan, capture, index)
        if len(plan.demoted) != demoted:
            self.mode, self.description = plan.mode, plan.description
        records = [
            r
            for r in records
            if any(r.layer is l for l, _ in plan.ghost) or any(r.layer is u for u, _, _ in plan.local)
        ]
        checks = []
        unchecked = [r for r in unchecked if id(r.layer) not in plan.axis0_ok]
        for rec in unchecked:  # shapes unknown at trace time: checked when the step runs
            for t in rec.outputs:
                checks.append(
                    tf.debugging.assert_equal(
                        tf.shape(t)[0],
                        base.batch_size_of(x),
                        message=(
                            f"tf_dp ghost clipper: an output of layer {rec.layer.name!r} does not "
                            "have the examples on axis 0 (its rule would group its rows as "
                            "examples); trace the step with a static batch size, which moves "
                            "such a layer to a per-example fallback"
                        ),
                    )
                )
        targets = [t for rec in records for t in rec.outputs]
        out_grads = (
            tape.gradient(total, targets, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            if targets
            else []
        )
        checks = [c for c in checks if c is not None]  # eager: already checked
        if checks:
            with tf.control_dependencies(checks):
                out_grads = [tf.identity(g) for g in out_grads]

        unit_vars = {id(layer): vs for layer, _, vs in plan.local}
        model_level = set(plan.model_level)
        for layer, entry in plan.ghost:
            if id(layer) in capture.nested:
                model_level.update(
                    _key(v) for v in _rule_variables(layer, entry) if _key(v) in index
                )
        for layer, _, vs in plan.local:
            if id(layer) in capture.nested:
                model_level.update(_key(v) for v in vs)
        records = [r for r in records if id(r.layer) not in capture.nested]
        parts: dict[int, list] = {}
        covered: dict[int, set] = {}  # layer -> variables its rule gave factors for (all calls)
        pos = 0
        for rec in records:
            grads = out_grads[pos : pos + len(rec.outputs)]
            pos += len(rec.outputs)
            if rec.entry is not None:
                own = [v for v in _rule_variables(rec.layer, rec.entry) if _key(v) in index]
                g = grads[0] if len(grads) == 1 and rec.entry.forward is None else grads
                pairs = list(rec.entry.rule(rec.layer, rec.inputs, g))
                covered.setdefault(id(rec.layer), set()).update(_key(v) for v, _ in pairs)
                for v, factor in pairs:
                    if _key(v) in index:
                        parts.setdefault(_key(v), []).append(factor)
            elif unit_vars.get(id(rec.layer)):
                own = unit_vars[id(rec.layer)]
                per_ex = _local_per_example(
                    rec, grads, own, loop=id(rec.layer) in plan.local_loop, batch=n
                )
                for v, pe in zip(own, per_ex):
                    parts.setdefault(_key(v), []).append(F.PerExample(pe))

        for rec in records:
            if rec.entry is None or id(rec.layer) not in covered:
                continue
            got = covered.pop(id(rec.layer))
            own = [v for v in _rule_variables(rec.layer, rec.entry) if _key(v) in index]
            missing = [v for v in own if _key(v) not in got]
            if missing:
                raise ValueError(
                    f"the ghost norm rule for {type(rec.layer).__name__} returned no factor for "
                    f"{[getattr(v, 'path', v.name) for v in missing]} of layer "
                    f"{rec.layer.name!r}; a rule must cover every trainable variable"
                )
        if model_level:
            fallback_vars = [v for v in variables if _key(v) in model_level]
            per_ex = _whole_model_per_example(
                loss_fn, data, fallback_vars, loop=plan.model_loop is not None
            )
            for v, pe in zip(fallback_vars, per_ex):
                parts.setdefault(_key(v), []).append(F.PerExample(pe))

        batch = tf.shape(losses)[0] // k
        squared, summers = [], []
        for v in variables:
            shape = list(v.shape)
            factors = parts.get(_key(v))
            if _key(v) in self.sparse_keys:  # a table released sparsely (engine: sparse_embeddings)
                sq, summer = _sparse_rows(v, factors, shape, k, batch)
                squared.append(sq)
                summers.append(summer)
                continue
            if not factors:  # the variable took no part in this forward pass
                squared.append(tf.zeros([batch], tf.float32))
                summers.append(lambda w, select, shape=shape: tf.zeros(shape, tf.float32))
                continue
            sq, summer = F.squared_norm_and_sum(F.group(F.combine(factors, shape), k), shape)
            squared.append(sq)
            summers.append(summer)
        # a record whose loss or norm is not finite gets weight 0 and is selected out of the sums
        group_losses = losses if k == 1 else tf.reshape(losses, [-1, k])
        weights, _ = base.record_weights(query, params, squared, group_losses)
        weights = tf.nest.flatten(weights)
        dense = [i for i, v in enumerate(variables) if _key(v) not in self.sparse_keys]
        dense_sums = base.guarded_sums(lambda select: [
            tf.cast(summers[i](weights[i], select), variables[i].dtype) for i in dense],
            [weights[i] for i in dense])
        clipped = [None] * len(variables)
        for i, total in zip(dense, dense_sums):
            clipped[i] = total
        for i in range(len(variables)):  # sparse tables: tf.IndexedSlices, selected in place
            if clipped[i] is None:
                clipped[i] = summers[i](weights[i], True)
        real = base.real_records(sw, base.batch_size_of(x))
        if k > 1:
            real = tf.reduce_any(tf.reshape(real, [-1, k]), axis=1)
        return base.ClippedGradients(
            clipped_sum=clipped,
            norms=base.global_norms(squared),
            num_records=base.batch_size_of(x) // k,
            sensitivity_multiplier=1.0,
            record_mask=real,
            y_pred=y_pred,
            losses=losses,
        )


def _sparse_rows(v, factors, shape, group_size, batch):
    """Squared norms and the weighted sum of a sparse table as ``tf.IndexedSlices`` of the
    clipped per-example rows (not merged: ``indices`` reshaped to ``[B, -1]`` are the ids)."""
    name = getattr(v, "path", None) or v.name
    if group_size != 1:
        raise ValueError(
            f"sparse_embeddings: user-level clipping (records_per_unit > 1) is not supported for "
            f"the sparse table {name}")
    if not factors:
        d = int(shape[1])
        empty = tf.IndexedSlices(tf.zeros([0, d]), tf.zeros([0], tf.int64),
                                 tf.constant(shape, tf.int64))
        return tf.zeros([batch], tf.float32), lambda w, select: empty
    f = F.combine(factors, shape)
    if not isinstance(f, F.Rows):
        raise ValueError(
            f"sparse_embeddings: the table {name} is not only looked up (it is also used as a "
            "matrix, e.g. a tied ReversibleEmbedding called with reverse=True, or its layer has no "
            "row rule): leave it out of SparseEmbeddingConfig(layers=...)")
    sq, _ = F.squared_norm_and_sum(f, shape)

    def summer(w, select):  # always selects (IndexedSlices stay out of base.guarded_sums)
        w = tf.cast(w, f.g.dtype)
        g = tf.where(tf.not_equal(w, 0)[:, None, None], f.g, 0.0) * w[:, None, None]
        return tf.IndexedSlices(tf.reshape(g, [-1, int(shape[1])]), tf.reshape(f.ids, [-1]),
                                tf.constant(shape, tf.int64))

    return sq, summer
