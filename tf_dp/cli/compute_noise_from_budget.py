"""compute_noise_from_budget: the noise multiplier DP-SGD needs for a target (epsilon, delta).

::

    compute_noise_from_budget --N=60000 --batch_size=256 --epsilon=3 --epochs=60 --delta=1e-5 \\
        [--accountant=rdp|moments|pld|gdp|all] \\
        [--sampling=poisson|shuffle|truncated_poisson|balls_in_bins] [--max_batch_size=B] \\
        [--microbatch_size=M] [--format=text|json]

Prints the smallest noise multiplier (within 0.1%) whose epsilon at delta is at most the target,
for each accountant (``gdp`` relies on the CLT approximation).  Bad input or an unreachable target
exits with status 2 and one line on stderr.  JSON: one object keyed by accountant name, each with
``noise_multiplier`` and ``epsilon`` (achieved), plus ``delta`` and ``assumptions``.
"""

from __future__ import annotations

import math

from absl import flags

from tf_dp.cli import _common

FLAGS = flags.FLAGS
_common.define_training_flags()
_common.define("float", "epsilon", None, "Target epsilon (> 0).")


def main(argv):
    if len(argv) > 1:
        raise _common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from tf_dp import accounting as acc

    _common.check_sizes(FLAGS.N, FLAGS.batch_size, FLAGS.steps, FLAGS.epochs, FLAGS.delta)
    _common.require("epsilon", FLAGS.epsilon)
    if FLAGS.epsilon is None or not (0 < FLAGS.epsilon < math.inf):
        raise _common.UsageError(f"--epsilon must be a finite number > 0, got {FLAGS.epsilon}")
    if FLAGS.microbatch_size is not None and FLAGS.microbatch_size <= 0:
        raise _common.UsageError(
            f"--microbatch_size must be a positive integer, got {FLAGS.microbatch_size}")
    names = list(acc.ACCOUNTANTS) if FLAGS.accountant == "all" else [FLAGS.accountant]
    kw = dict(epochs=FLAGS.epochs, steps=FLAGS.steps, sampling=FLAGS.sampling,
              microbatch_size=FLAGS.microbatch_size,
              max_batch_size=_common.max_batch_size(FLAGS.sampling, FLAGS.N, FLAGS.batch_size,
                                                    FLAGS.max_batch_size))
    if FLAGS.sampling == "truncated_poisson" and FLAGS.accountant == "all":
        names.remove("gdp")  # no analysis of truncation; rdp and pld have one
    out = {}
    for name in names:
        sigma = acc.calibrate_noise_multiplier(FLAGS.epsilon, FLAGS.delta, FLAGS.N,
                                               FLAGS.batch_size, accountant=name, **kw)
        res = acc.dp_sgd_epsilon(FLAGS.N, FLAGS.batch_size, sigma, FLAGS.delta, accountant=name,
                                 **kw)
        out[name] = (sigma, res)
    if FLAGS.format == "json":
        obj = {n: {"noise_multiplier": s, "epsilon": r.epsilon, "certified": r.certified}
               for n, (s, r) in out.items()}
        obj["delta"] = FLAGS.delta
        obj["assumptions"] = "; ".join(f"{n}: {r.assumptions}" for n, (s, r) in out.items())
        print(_common.to_json(obj))
        return 0
    print(f"Noise multiplier for epsilon <= {FLAGS.epsilon:g} at delta = {FLAGS.delta:g} "
          f"(N={FLAGS.N}, batch size {FLAGS.batch_size}, {out[names[0]][1].steps} steps):")
    for name, (sigma, r) in out.items():
        kind = "certified" if r.certified else "APPROXIMATE (CLT), not certified"
        print(f"  [{name}] noise_multiplier = {sigma:.4g} -> epsilon = {r.epsilon:.4g} ({kind})")
    print(f"Assumptions: {out[names[0]][1].assumptions}")
    return 0


FLAG_NAMES = _common.TRAINING_FLAGS + ("epsilon",)


def run():
    _common.run_main(main, __doc__, FLAG_NAMES)


if __name__ == "__main__":
    run()
