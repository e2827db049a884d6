# %% [markdown]
# # Privacy accounting: from a training run to a privacy guarantee
#
# DP-SGD releases one noisy gradient per step. Each release leaks a little about every example in
# its batch, and an **accountant** adds these small leaks up into one statement about the whole
# run: an `(epsilon, delta)` pair, or a whole tradeoff curve. This notebook is about that
# arithmetic, with no training at all (the privacy cost of DP-SGD depends only on its
# hyperparameters, never on the data):
#
# 1. `compute_dp_sgd_privacy` from the shell and the same numbers from Python;
# 2. the four accountants (moments, RDP, PLD, GDP): what they print and why they differ, on the
#    settings of Table 1 of Bu et al. 2019, *Deep learning with Gaussian differential privacy*;
# 3. tradeoff curves (f-DP): the privacy of one run as the errors of an attacker, drawn for the
#    GDP approximation and the certified PLD bound;
# 4. shuffled fixed-size batches vs Poisson sampling: what giving up amplification costs;
# 5. calibrating the noise for a target budget.

# %% [markdown]
# ## Parameters
#
# `SMALL` (set by `TF_DP_TUTORIAL_SMALL=1`, as the test suite does) makes the PLD accountant use a
# coarser grid (`1e-3` instead of `1e-4`) and skips calibrating the noise with the PLD accountant.
# The coarser grid's results stay certified upper bounds, just slightly looser (by about 0.5%
# here). Either way the notebook is quick: about 10 s on a 2-core CPU.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("TF_DP_TUTORIAL_SMALL", "0") == "1"

PLD_GRID = 1e-3 if SMALL else None  # None: the PLD accountant's default grid (1e-4)
CALIBRATION_ACCOUNTANTS = ("rdp",) if SMALL else ("rdp", "pld")
DELTA = 1e-5

# %% [markdown]
# ## 1. `compute_dp_sgd_privacy`, from the shell and from Python
#
# The setting of the second row of Table 1 of Bu et al. 2019: MNIST's 60,000 examples, batches of
# expected size 256 (so each example is in a batch with probability `q = 256/60000`), noise
# multiplier `sigma = 1.1`, 60 epochs, `delta = 1e-5`.
#
# In a terminal, or in a notebook cell starting with `!`:
#
# ```
# compute_dp_sgd_privacy --N=60000 --batch_size=256 --noise_multiplier=1.1 --epochs=60 --delta=1e-5
# ```
#
# Here we run it through `subprocess` so that the same cell works everywhere:

# %%
import shutil
import subprocess
import sys


def shell(*args):
    """Runs one of tf_dp's command-line tools and prints what it prints."""
    tool = shutil.which(args[0])
    cmd = [tool] if tool else [sys.executable, "-m", f"tf_dp.cli.{args[0]}"]
    out = subprocess.run(cmd + list(args[1:]), capture_output=True, text=True)
    print(out.stdout + out.stderr)


shell(
    "compute_dp_sgd_privacy", "--N=60000", "--batch_size=256", "--noise_multiplier=1.1",
    "--epochs=60", "--delta=1e-5",
)

# %% [markdown]
# The statement says which accountant produced the number, whether it is a proven bound, and the
# assumptions behind it (add/remove-one adjacency, Poisson sampling). From Python,
# `dp_sgd_epsilon` returns the same thing as a `PrivacyResult`:

# %%
from tf_dp.accounting import dp_sgd_epsilon

result = dp_sgd_epsilon(60000, 256, 1.1, DELTA, epochs=60)
print(f"epsilon = {result.epsilon:.3f}, certified = {result.certified}, "
      f"{result.steps} steps, optimal Renyi order {result.order}")

# %% [markdown]
# After training, you analyse the run's **ledger** instead, the record of what actually ran
# (`compute_dp_sgd_privacy --ledger run.ledger.json`, or
# `tf_dp.accounting.compute_epsilon("run.ledger.json", delta)`; the `classification_privacy`
# notebook does it). `dp_sgd_entries` writes the ledger DP-SGD *would* record for given
# hyperparameters, one entry per step, and `compute_epsilon` analyses it like any ledger:

# %%
from tf_dp.accounting import compute_epsilon, dp_sgd_entries

ledger = dp_sgd_entries(60000, 256, 1.1, epochs=60)
print(f"{len(ledger)} steps; each recorded as:\n  {ledger[0]}")
print(compute_epsilon(ledger, DELTA).epsilon)

# %% [markdown]
# ## 2. Four accountants, four numbers
#
# All four analyse the same mechanism (the Poisson-subsampled Gaussian, composed over the steps);
# they differ in how much slack their mathematics leaves:
#
# - **`moments`**: the moments accountant of Abadi et al. 2016. It tracks the Rényi divergence
#   of every order `a` (the "moments" of the privacy loss), adds them over steps and converts with
#   the tail bound `delta = min_a exp((a - 1) (RDP(a) - epsilon))`. Certified, but loose.
# - **`rdp`**: the same Rényi curve with a tighter, still proven, conversion to `(epsilon, delta)`
#   (Canonne, Kamath and Steinke 2020). The default: certified and fast.
# - **`pld`**: composes the full privacy loss *distribution* numerically (by FFT), discretised so
#   that every rounding errs on the pessimistic side. Certified and the tightest: nothing is lost
#   to a conversion. Slower (seconds).
# - **`gdp`**: the privacy central limit theorem of Bu et al. 2019. Many subsampled steps compose
#   to approximately `mu`-Gaussian DP with `mu = q sqrt(T (e^(1/sigma^2) - 1))`. Instant and
#   elegant, but an **asymptotic approximation**: it is not a bound, and it can be too optimistic.
#
# Table 1 of Bu et al. 2019 (MNIST, `q = 256/60000`, `delta = 1e-5`) printed `mu`, the CLT epsilon
# and the moments accountant's epsilon for six settings. Side by side with what tf_dp computes:

# %%
import math
import time

TABLE1 = [  # (sigma, epochs, paper mu, paper eps CLT, paper eps moments accountant)
    (1.3, 15, 0.23, 0.83, 1.19),
    (1.1, 60, 0.57, 2.32, 3.01),
    (0.7, 45, 1.13, 5.07, 7.10),
    (0.6, 62, 2.00, 9.98, 13.27),
    (0.55, 68, 2.76, 14.98, 18.72),
    (0.5, 100, 4.78, 31.12, 32.40),
]

start = time.time()
table = []
print("                | mu          | eps, CLT      | eps, certified accountants")
print("sigma epochs     | tf_dp paper | gdp    paper  | paper MA moments     rdp     pld")
for sigma, epochs, paper_mu, paper_clt, paper_ma in TABLE1:
    row = {"sigma": sigma, "epochs": epochs, "paper_mu": paper_mu, "paper_clt": paper_clt,
           "paper_ma": paper_ma}
    # the paper's step count T = epochs * n / b (the samplers run round(n / b) steps per epoch)
    entries = dp_sgd_entries(60000, 256, sigma, steps=math.ceil(epochs * 60000 / 256))
    for name in ("gdp", "moments", "rdp", "pld"):
        r = compute_epsilon(entries, DELTA, accountant=name, discretization=PLD_GRID)
        row[name] = r.epsilon
        if name == "gdp":
            row["mu"] = r.mu
    table.append(row)
    print(f"{sigma:5.2f} {epochs:6d}     | {row['mu']:5.2f} {paper_mu:5.2f} | {row['gdp']:6.2f} "
          f"{paper_clt:6.2f} | {paper_ma:8.2f} {row['moments']:7.2f} {row['rdp']:7.2f} "
          f"{row['pld']:7.2f}")
print(f"({time.time() - start:.0f} s)")

# %% [markdown]
# How to read it:
#
# - `mu` and the CLT epsilon match the paper: `gdp` is the paper's formula.
# - `moments` matches the paper's moments-accountant column for the first three rows; for the last
#   three, tf_dp's moments accountant comes out 0.2-2% above the printed values.
# - `rdp` is always below `moments` (same curve, better conversion) and `pld` below `rdp`: the
#   certified numbers improve as the analysis gets more exact.
# - `gdp` is close to `pld` and usually below it, so **below a certified upper bound**: it is not
#   itself a bound. In the last row (`sigma = 0.5`, 100 epochs) it is *above* the PLD bound
#   instead: the CLT is an approximation in both directions. Report `pld` (or `rdp`); use `gdp`
#   for intuition and comparison with papers that used it.
#
# The same comparison as epsilon grows during one run (`sigma = 1.1`):

# %%
import matplotlib.pyplot as plt
import numpy as np

epoch_grid = [1, 2, 5, 10, 20, 40, 60]
curves = {name: [] for name in ("moments", "rdp", "pld", "gdp")}
for epochs in epoch_grid:
    entries = dp_sgd_entries(60000, 256, 1.1, epochs=epochs)
    for name in curves:
        curves[name].append(
            compute_epsilon(entries, DELTA, accountant=name, discretization=PLD_GRID).epsilon
        )

fig, ax = plt.subplots(figsize=(6, 4))
for name, style in (("moments", "s-"), ("rdp", "o-"), ("pld", "^-"), ("gdp", "x--")):
    label = name + (" (approximation)" if name == "gdp" else "")
    ax.plot(epoch_grid, curves[name], style, label=label)
ax.set_xlabel("epochs")
ax.set_ylabel(f"epsilon at delta = {DELTA:g}")
ax.set_title("N = 60000, batch 256, sigma = 1.1")
ax.legend()
plt.show()

# %% [markdown]
# ## 3. Tradeoff curves: privacy as an attacker's errors
#
# `(epsilon, delta)` compresses a guarantee into two numbers. *f-DP* (Dong, Roth and Su 2019), the
# language of Bu et al. 2019, keeps all of it. Think of an attacker who sees the trained model and
# must decide whether a given person's record was in the training data. Any such test has a
# type I error `alpha` (saying "in" when the record was out) and a type II error `beta` (saying
# "out" when it was in). The **tradeoff function** `f(alpha)` is the smallest `beta` any attacker
# can achieve at type I error `alpha`:
#
# - perfect privacy: `f(alpha) = 1 - alpha` (the attacker can only guess);
# - no privacy: `f = 0` (the attacker can be right every time);
# - `mu`-GDP: `f(alpha) = G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)`, as hard as telling
#   `N(0, 1)` from `N(mu, 1)` apart from one draw;
# - `(epsilon, delta)`-DP: `f(alpha) >= max(0, 1 - delta - e^eps alpha, e^-eps (1 - delta - alpha))`.
#
# A mechanism that is `(epsilon, delta(epsilon))`-DP for *every* epsilon is bounded by all those
# lines at once: the upper envelope over epsilon is its tradeoff curve (a certified bound when the
# `delta(epsilon)` are). We take `delta(epsilon)` from the PLD accountant, composing the privacy
# loss distribution of the run once for each direction (adding or removing a record) and reading
# the whole curve off it.
#
# `tf_dp.accounting` draws these curves: `pld_tradeoff` (the certified envelope from the PLD
# accountant), `gaussian_tradeoff` (mu-GDP) and `tradeoff_from_epsilon_delta` (one or more
# `(epsilon, delta)` pairs).

# %%
import math

from tf_dp.accounting import (
    SubsampledGaussian,
    gaussian_tradeoff,
    pld_tradeoff,
    tradeoff_from_epsilon_delta,
)

q, sigma, epochs = 256 / 60000, 1.1, 60  # Table 1, second row
steps = math.ceil(epochs / q)
mu = table[1]["mu"]

alpha = np.linspace(0.0, 1.0, 1001)
f_pld = pld_tradeoff([(SubsampledGaussian(q, sigma), steps)], alpha, h=PLD_GRID)
f_gdp = gaussian_tradeoff(alpha, mu)
eps_moments = table[1]["moments"]
f_moments = tradeoff_from_epsilon_delta(alpha, [eps_moments], [DELTA])

fig, ax = plt.subplots(figsize=(5.5, 5.5))
ax.plot(alpha, 1 - alpha, color="gray", linestyle=":", label="perfect privacy")
ax.plot(alpha, f_gdp, label=f"GDP, mu = {mu:.2f} (CLT approximation)")
ax.plot(alpha, f_pld, "--", label="PLD bound (certified)")
ax.plot(alpha, f_moments, label=f"moments accountant: ({eps_moments:.2f}, {DELTA:g})-DP")
ax.set_xlabel("type I error (alpha)")
ax.set_ylabel("type II error (beta)")
ax.set_title(f"sigma = {sigma}, {epochs} epochs, q = 256/60000")
ax.set_aspect("equal")
ax.legend(loc="upper right", fontsize=8)
plt.show()

# %% [markdown]
# The curve is what an attacker can do, at every operating point. Above a curve is impossible for
# any attacker. The single `(epsilon, delta)` pair of the moments accountant allows attackers
# far more powerful than the run's PLD curve does: the pair keeps only one line of the envelope.
#
# One summary Bu et al. quote: the smallest total error `alpha + beta` any attacker can achieve
# (1 means pure guessing). For this run they report 77.6% from the CLT against 9.4% from the
# moments accountant's `(3.01, 1e-5)`:

# %%
min_error = {
    "GDP (approximation)": float(np.min(alpha + f_gdp)),
    "PLD bound (certified)": float(np.min(alpha + f_pld)),
    "moments accountant (eps, delta)": float(np.min(alpha + f_moments)),
}
for name, value in min_error.items():
    print(f"{name:<32} min(alpha + beta) >= {value:.3f}")

# %% [markdown]
# The certified PLD curve gives almost exactly the CLT's answer (the paper's 77.6% used `mu`
# rounded to 0.57), and it is a proof rather than an approximation. A single `(epsilon, delta)`
# pair is too coarse to describe a run of DP-SGD: it keeps one tangent line of the curve.

# %% [markdown]
# ## 4. Shuffled batches vs Poisson sampling
#
# The accountants above assume **Poisson sampling**: every step, every example joins the batch
# independently with probability `q`. That randomness is where most of DP-SGD's privacy comes from
# (*amplification by subsampling*: most steps never see a given example).
#
# The usual input pipeline does something else: shuffle the data once per epoch and cut it into
# fixed-size batches (what `model.fit(x, y, batch_size=...)` does). Each example is then in
# exactly one batch per epoch, and no proven amplification result covers that in general. tf_dp
# records such runs as `shuffle` and reports the bound that does not rely on amplification: each
# epoch counts as one pass over the whole data set, with the neighbouring data sets *replacing*
# one record (sensitivity `2C`, because adding a record would move every later batch). The cost:

# %%
epoch_list = [1, 5, 15, 60]
print(f"sigma = 1.1, N = 60000, batch 256, delta = {DELTA:g}")
print(f"{'epochs':>6} | {'poisson rdp':>11} {'poisson pld':>11} | {'shuffle rdp':>11} "
      f"{'shuffle pld':>11}")
sampling_cost = []
for epochs in epoch_list:
    row = {}
    for sampling in ("poisson", "shuffle"):
        for name in ("rdp", "pld"):
            entries = dp_sgd_entries(60000, 256, 1.1, epochs=epochs, sampling=sampling)
            row[sampling, name] = compute_epsilon(
                entries, DELTA, accountant=name, discretization=PLD_GRID
            ).epsilon
    sampling_cost.append(row)
    print(f"{epochs:6d} | {row['poisson', 'rdp']:11.2f} {row['poisson', 'pld']:11.2f} | "
          f"{row['shuffle', 'rdp']:11.2f} {row['shuffle', 'pld']:11.2f}")

# %% [markdown]
# Two orders of magnitude. Shuffled batches may well be about as private as Poisson ones in
# practice, but that is not what has been proven, so tf_dp does not print it as a guarantee.
# What to do:
#
# - train on `tf_dp.data.poisson_batches(x, y, sampling_probability=q)` (the
#   `classification_privacy` notebook does), and the accountants apply amplification;
# - with your own `tf.data` pipeline, declare what it does with
#   `model.optimizer.set_sampling(n, q, "poisson" | "shuffle")`, and make it true.
#
# (The comparison uses the accountants' `sampling="shuffle"` option; tf_dp does not implement the
# recent *shuffling-specific* analyses, which give bounds between these two columns.)

# %% [markdown]
# ## 5. Choosing the noise for a budget
#
# Usually the budget comes first: "epsilon at most 3 at delta = 1e-5 after 15 epochs". The noise
# multiplier that achieves it is found by root finding on the accountant,
# `calibrate_noise_multiplier`, or from the shell
# `compute_noise_from_budget --N=60000 --batch_size=256 --epsilon=3 --epochs=15 --delta=1e-5`.

# %%
shell(
    "compute_noise_from_budget", "--N=60000", "--batch_size=256", "--epsilon=3", "--epochs=15",
    "--delta=1e-5",
)

# %%
from tf_dp.accounting import calibrate_noise_multiplier

TARGET_EPSILON, EPOCHS = 3.0, 15
calibrated = {}
for name in CALIBRATION_ACCOUNTANTS:
    start = time.time()
    calibrated[name] = calibrate_noise_multiplier(
        TARGET_EPSILON, DELTA, n=60000, batch_size=256, epochs=EPOCHS, accountant=name
    )
    check = dp_sgd_epsilon(60000, 256, calibrated[name], DELTA, epochs=EPOCHS, accountant=name)
    print(f"[{name}] noise_multiplier = {calibrated[name]:.4f} -> epsilon = {check.epsilon:.4f} "
          f"({time.time() - start:.1f} s)")

# %% [markdown]
# The tighter accountant needs less noise for the same guarantee, and less noise means a more
# accurate model:

# %%
if "pld" in calibrated:
    saving = 1 - calibrated["pld"] / calibrated["rdp"]
    print(f"the PLD accountant certifies the same budget with {100 * saving:.1f}% less noise")

# %% [markdown]
# Budget checks during training work the same way:
# `tf_dp.keras.PrivacyBudget(target_epsilon, delta, accountant="pld")` stops `fit` before the step
# that would overspend.
#
# ## Summary
#
# - The privacy cost of DP-SGD is a function of `(q, sigma, steps, delta)`, computed before
#   training (planning) and from the ledger after it (what actually ran).
# - `pld` ≤ `rdp` ≤ `moments` are all proven bounds; report the tightest you can afford. `gdp` is an
#   approximation: useful, fast, sometimes optimistic, and always labelled as such.
# - A tradeoff curve says more than any one `(epsilon, delta)` pair.
# - Poisson sampling is worth orders of magnitude of epsilon; fixed-size shuffled batches get the
#   bound without amplification.
