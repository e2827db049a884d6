"""compute_dp_sgd_privacy: the privacy guarantee of a DP-SGD run, in plain words or JSON.

From hyperparameters::

    compute_dp_sgd_privacy --N=60000 --batch_size=256 --noise_multiplier=1.1 --epochs=60 \\
        --delta=1e-5 [--accountant=rdp|moments|pld|gdp|all] \\
        [--sampling=poisson|shuffle|truncated_poisson|balls_in_bins] [--max_batch_size=B] \\
        [--microbatch_size=M] [--jl_projections=R] [--format=text|json]

or from a ledger file written during training (``--ledger=run.ledger.json``; then the ledger's
recorded events are used and the hyperparameter flags are ignored). The output names the unit of
privacy (user-level or example-level) and whether tf_dp performed the sampling or the user
declared it (not checked); JSON: under ``sampling``.

``--audit_report=audit.json`` (written by ``tf_dp.auditing.AuditReport.save``) prints the audit's
measured lower bound beside the analysis (JSON: under ``audit``), and flags a lower bound above
an accountant's epsilon at the same delta: the mechanism or its accounting is then broken.

``--microbatch_size`` > 1 means each clipped gradient covers several examples, so the sensitivity
under add/remove adjacency is 2C and the effective noise multiplier is halved.
``--jl_projections=R`` accounts for DP-SGD-JL with R projections (PLD accountant only: it is the
default then; with ``--accountant=all`` the others are listed as skipped).  JSON output: one object keyed by accountant name, each
with ``epsilon`` (the string ``"Infinity"`` when no finite bound holds; ``null`` only for an
accountant skipped, with its reason under ``skipped``), ``order`` (rdp/moments) or ``mu`` (gdp), plus top-level
``delta`` and ``assumptions``.  Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import math

from absl import flags

from tf_dp.cli import _common

FLAGS = flags.FLAGS
_common.define_training_flags()
_common.define("float", "noise_multiplier", None, "Noise stddev divided by the clip norm (>= 0).")
_common.define("integer", "jl_projections", None,
               "JL projections r (> 0): DP-SGD-JL accounting (pld accountant only).")
_common.define("string", "ledger", None,
               "Ledger file to analyse instead of hyperparameters (then only --delta, "
               "--accountant and --format are read).")
_common.define("string", "audit_report", None,
               "Audit report (AuditReport.save) whose measured lower bound is printed beside the "
               "analysis.")


def main(argv):
    if len(argv) > 1:
        raise _common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from tf_dp import accounting as acc
    from tf_dp.ledger.ledger_file import read_ledger_runs

    delta = FLAGS.delta
    _common.require("delta", delta)
    if delta is None or not (0.0 < delta < 1.0):
        raise _common.UsageError(f"--delta must be in (0, 1), got {delta}")
    audit = None
    if FLAGS.audit_report:
        from tf_dp.auditing.report_file import read_report_file

        audit = read_report_file(FLAGS.audit_report)  # ValueError -> exit 2
    if FLAGS.ledger:
        # Runs, never one entry per step. LedgerFileError is a ValueError -> exit 2.
        runs = read_ledger_runs(FLAGS.ledger)
        source = f"ledger file {FLAGS.ledger} ({sum(c for _, c in runs)} steps)"
        claim = acc.sampling_claims(runs)  # the unit (user/example) and who sampled

        def analyse(name):
            return acc.compute_epsilon(runs, delta, name)

        has_jl = any(q.mechanism == "jl" for e, _ in runs for q in e.queries)
    else:
        _common.check_sizes(FLAGS.N, FLAGS.batch_size, FLAGS.steps, FLAGS.epochs, delta)
        nm = FLAGS.noise_multiplier
        _common.require("noise_multiplier", nm)
        if nm is None or not (nm == 0 or acc.MIN_NOISE_MULTIPLIER <= nm < math.inf):
            raise _common.UsageError(
                f"--noise_multiplier must be 0 (no noise) or a finite number >= "
                f"{acc.MIN_NOISE_MULTIPLIER:g}, got {nm}")
        if FLAGS.microbatch_size is not None and FLAGS.microbatch_size <= 0:
            raise _common.UsageError(
                f"--microbatch_size must be a positive integer, got {FLAGS.microbatch_size}")
        if FLAGS.jl_projections is not None and FLAGS.jl_projections <= 0:
            raise _common.UsageError(
                f"--jl_projections must be a positive integer, got {FLAGS.jl_projections}")
        hyper = dict(steps=FLAGS.steps, epochs=FLAGS.epochs, sampling=FLAGS.sampling,
                     microbatch_size=FLAGS.microbatch_size, jl_projections=FLAGS.jl_projections,
                     max_batch_size=_common.max_batch_size(FLAGS.sampling, FLAGS.N,
                                                           FLAGS.batch_size, FLAGS.max_batch_size))
        # One entry and a step count: any number of steps is composed without being listed.
        entry, steps = acc.dp_sgd_run(FLAGS.N, FLAGS.batch_size, FLAGS.noise_multiplier, **hyper)
        z = entry.effective_noise_multiplier()
        size = f"{steps} steps"
        if FLAGS.sampling == "shuffle":
            per_epoch = acc.shuffle_steps_per_epoch(FLAGS.N, FLAGS.batch_size / FLAGS.N)
            size += (f" ({acc.shuffle_epochs(steps, FLAGS.N, FLAGS.batch_size / FLAGS.N)} "
                     f"epochs of {per_epoch} steps)")
        elif FLAGS.sampling == "balls_in_bins":
            per_epoch = round(1 / entry.sampling.selection_probability)
            size += f" ({steps // per_epoch} epochs of {per_epoch} balls-in-bins steps)"
        elif FLAGS.sampling == "truncated_poisson":
            size += f" (truncated Poisson, at most {hyper['max_batch_size']} examples a step)"
        source = (f"DP-SGD with N={FLAGS.N}, batch size {FLAGS.batch_size}, {size}, "
                  f"effective noise multiplier {z:g}")
        claim = ("Unit and sampling: example-level (one example); the sampling is "
                 "the one given on the command line, not a run tf_dp checked.")

        def analyse(name):
            return acc.dp_sgd_epsilon(FLAGS.N, FLAGS.batch_size, FLAGS.noise_multiplier, delta,
                                      accountant=name, **hyper)

        has_jl = FLAGS.jl_projections is not None
    truncated = (not FLAGS.ledger and FLAGS.sampling == "truncated_poisson")
    accountant = FLAGS.accountant
    if has_jl and accountant == "rdp" and not FLAGS["accountant"].present:
        accountant = "pld"  # the default accountant cannot analyse JL steps; pld can
    names = list(acc.ACCOUNTANTS) if accountant == "all" else [accountant]
    results, skipped = {}, {}
    for name in names:
        if has_jl and name != "pld":
            skipped[name] = "not applicable to JL steps (use pld)"
            if accountant != "all":
                raise _common.UsageError(
                    f"--accountant={name} cannot analyse JL steps; use --accountant=pld or all")
            continue
        if truncated and name == "gdp" and accountant == "all":
            skipped[name] = "no analysis of truncated Poisson (use rdp or pld)"
            continue
        results[name] = analyse(name)
    audit_lines, audit_out = _audit_comparison(audit, results, delta)
    if FLAGS.format == "json":
        out = {}
        for name, r in results.items():
            d = {"epsilon": r.epsilon, "certified": r.certified}
            if r.order is not None:
                d["order"] = r.order
            if r.mu is not None:
                d["mu"] = r.mu
            out[name] = d
        for name, why in skipped.items():
            out[name] = {"epsilon": None, "skipped": why}
        out["delta"] = delta
        out["sampling"] = claim
        out["assumptions"] = "; ".join(
            [f"source: {source}"] + [f"{n}: {r.assumptions}" for n, r in results.items()])
        if audit_out is not None:
            out["audit"] = audit_out
        print(_common.to_json(out))
        return 0
    print(f"Privacy of {source}, at delta = {delta:g}:")
    print(claim)
    for name, r in results.items():
        print()
        print(str(r))
    for name, why in skipped.items():
        print(f"\n[{name}] skipped: {why}")
    for line in audit_lines:
        print(line)
    return 0


def _audit_comparison(audit, results, delta):
    """Text lines and the JSON object for an audit report beside the accountants' results."""
    if audit is None:
        return [], None
    same_delta = abs(audit["delta"] - delta) <= 1e-12 * max(delta, audit["delta"])
    above = sorted(n for n, r in results.items() if same_delta and audit["lower_bound"] > r.epsilon)
    where = (f"{audit.get('threat_model', '?')}, {audit.get('trainings', '?')} training(s) x "
             f"{audit.get('num_canaries', '?')} canaries")
    lines = [
        "",
        f"Audit ({FLAGS.audit_report}; {where}): measured lower bound epsilon >= "
        f"{audit['lower_bound']:.4g} at delta = {audit['delta']:g}, "
        f"{audit['confidence']:.0%} confidence (the audited training's own certificate: "
        f"{audit['certified_epsilon']:.4g}).",
    ]
    if not same_delta:
        lines.append(f"  not compared: the audit's delta ({audit['delta']:g}) differs from "
                     f"--delta ({delta:g}).")
    elif above:
        lines.append(f"  VIOLATION: above the epsilon of {', '.join(above)}: the mechanism or its "
                     "accounting is broken.")
    else:
        lines.append("  consistent: below every epsilon above (an audit can show a certificate "
                     "wrong, never prove it right).")
    if audit.get("violation") is True:
        lines.append("  the audit's own verdict: VIOLATION of its training's certificate (a bound "
                     "above its epsilon, or a broken (eps, delta) pair of its profile).")
    power = audit.get("smallest_detectable")
    if isinstance(power, dict) and isinstance(power.get("epsilon"), (int, float)):
        lines.append(f"  power: a run with epsilon {power['epsilon']:.4g} (noise multiplier / "
                     f"{power.get('noise_factor', float('nan')):.3g}) is flagged with probability "
                     f">= {power.get('probability', 0.9):g}; smaller violations may go unseen.")
    if isinstance(audit.get("sees"), str):
        lines.append(f"  it {audit['sees'].split('; power:')[0]}.")
    out = {"lower_bound": audit["lower_bound"], "delta": audit["delta"],
           "confidence": audit["confidence"], "file": FLAGS.audit_report,
           "compared": same_delta, "above": above,
           "threat_model": audit.get("threat_model"), "violation": audit.get("violation"),
           "smallest_detectable": power}
    return lines, out


FLAG_NAMES = _common.TRAINING_FLAGS + (
    "noise_multiplier", "jl_projections", "ledger", "audit_report")


def run():
    _common.run_main(main, __doc__, FLAG_NAMES)


if __name__ == "__main__":
    run()
