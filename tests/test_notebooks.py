"""The tutorial notebooks: stored clean, badge and set-up cell, and executed top to bottom.

Every ``tutorials/*.ipynb`` is run in small mode (``TF_DP_TUTORIAL_SMALL=1``) in a fresh kernel
(nbclient + ipykernel), with matplotlib's Agg backend, on real data: Debian's Fashion-MNIST when
it is installed, otherwise a small real set in the same format (scikit-learn's digits, see
``tests/idx_fixtures.py``). No MNIST download is attempted. After the notebook, one extra cell
prints the values the checks below read (accuracy, epsilon, ...) as JSON.
"""

import glob
import importlib.util
import json
import math
import os

import nbclient  # test dependencies (setup.py extras "test")
import nbformat
import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = os.path.join(ROOT, "tutorials")
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
# Text notebooks' offline corpus (IMDb needs a download): Debian's fortunes, installed by .ci/run.
DEBIAN_FORTUNES = "/usr/share/games/fortunes"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(TUTORIALS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


colab = _load("_colab")
builder = _load("_build_notebooks")

NOTEBOOKS = sorted(glob.glob(os.path.join(TUTORIALS, "*.ipynb")))
NAMES = [os.path.basename(p)[: -len(".ipynb")] for p in NOTEBOOKS]

# What each notebook must have produced: a cell printing JSON, and checks of its values.
CHECKS = {
    "classification_privacy": (
        "import json, math\n"
        "print(json.dumps({'accuracy': float(test_accuracy), 'epsilon': float(final_epsilon),"
        " 'budget': float(TARGET_EPSILON), 'spent': float(budget.epsilon_spent),"
        " 'history_eps': [float(e) for e in history.history['epsilon']],"
        " 'sweep': [[float(v) for v in row] for row in sweep],"
        " 'baseline': float(baseline_accuracy),"
        " 'accountants': {k: [r.epsilon, r.certified] for k, r in results.items()}}))"
    ),
    "privacy_accounting": (
        "import json\n"
        "print(json.dumps({'table': table, 'min_error': min_error, 'curves': curves,"
        " 'sampling': [{f'{k[0]} {k[1]}': v for k, v in row.items()} for row in sampling_cost],"
        " 'calibrated': calibrated, 'target': TARGET_EPSILON, 'epochs': EPOCHS}))"
    ),
    "custom_layers_and_ghost_clipping": (
        "import json\n"
        "print(json.dumps({'choices': choices, 'rule': list(rule_errors),"
        " 'mistaken': list(mistaken_errors), 'check_batch': CHECK_BATCH,"
        " 'per_layer_error': per_layer_check_error, 'clips': [float(c) for c in clips],"
        " 'stddevs': [float(s) for s in stddevs], 'z': NOISE_MULTIPLIER,"
        " 'effective': [float(e) for e in effective], 'epsilon': per_layer_epsilon,"
        " 'n': int(n), 'batch': BATCH_SIZE, 'delta': DELTA, 'steps': ledger.num_samples,"
        " 'clipper': custom_clipper.name,"
        " 'accuracy': [float(custom_accuracy), float(per_layer_accuracy)]}))"
    ),
    "migrating_from_tf_privacy": (
        "import json\n"
        "print(json.dumps({'n': int(n), 'batch': BATCH_SIZE, 'sigma': NOISE_MULTIPLIER,"
        " 'epochs': EPOCHS, 'delta': DELTA, 'cli': cli_poisson, 'poisson': ledger_poisson,"
        " 'shuffle': ledger_shuffled, 'microbatch': cli_microbatch,"
        " 'steps': [shuffled.optimizer.ledger.num_samples, poisson.optimizer.ledger.num_samples],"
        " 'accuracy': [float(shuffled_accuracy), float(poisson_accuracy)]}))"
    ),
    "correlated_noise": (
        "import json\n"
        "print(json.dumps({'sens': sens, 'sigmas': sigmas, 'epochs': EPOCHS, 'bands': BANDS,"
        " 'parts': PARTS, 'target': TARGET_EPSILON, 'delta': DELTA,"
        " 'resumed_step': int(resumed_step), 'accuracy': accuracy}))"
    ),
    "sparse_embeddings": (
        "import json\n"
        "print(json.dumps({'n': N, 'batch': BATCH, 'steps': STEPS, 'z': NOISE_MULTIPLIER,"
        " 'sigma1': SELECTION_NOISE_MULTIPLIER, 'sigma2': SIGMA2, 'delta': DELTA,"
        " 'threshold': THRESHOLD, 'epsilons': epsilons, 'accountant': ACCOUNTANT, 'file_epsilon': file_epsilon,"
        " 'queries': [[e.l2_sensitivity, e.noise_stddev] for e in entries[0].queries],"
        " 'file_steps': len(entries), 'accuracy': accuracies, 'baseline': baseline_accuracy,"
        " 'bayes': bayes, 'moved': moved.tolist(), 'in_batch': in_batch.tolist(), 'items': ITEMS}))"
    ),
    "dp_user_level": (
        "import json\n"
        "print(json.dumps({'n': int(n), 'n_users': int(n_users), 'q': [q_ex, q_user],"
        " 'steps': steps, 'sigma': NOISE_MULTIPLIER, 'delta': DELTA,"
        " 'epsilon': [example_result.epsilon, user_result.epsilon],"
        " 'ledger_steps': [example_model.optimizer.ledger.num_samples,"
        " user_model.optimizer.ledger.num_samples], 'claims': claims,"
        " 'user_sampling': [[e.sampling.population_size, e.sampling.selection_probability,"
        " e.sampling.unit, e.sampling.records_per_unit] for e, _ in"
        " user_model.optimizer.ledger.runs()], 'k': K,"
        " 'accuracy': [float(example_accuracy), float(user_accuracy)]}))"
    ),
    "text_classification": (
        "import json\n"
        "print(json.dumps({'data': data_name, 'n': int(n), 'batch': BATCH_SIZE,"
        " 'sigma': NOISE_MULTIPLIER, 'delta': DELTA, 'r': JL_PROJECTIONS,"
        " 'steps': [exact_ledger.num_samples, jl_ledger.num_samples],"
        " 'ledger_eps': [exact_result.epsilon, jl_result.epsilon], 'exact_eps': exact_epsilon,"
        " 'eps_vs_r': {str(k): v for k, v in epsilon_vs_r.items()},"
        " 'history_eps': exact_history.history['epsilon'],"
        " 'accuracy': [float(exact_accuracy), float(jl_accuracy), float(baseline_accuracy)],"
        " 'majority': majority, 'classes': len(class_names),"
        " 'test_labels': [int(v) for v in y_test]}))"
    ),
    "privacy_auditing": (
        "import json\n"
        "print(json.dumps({'certified': correct.certified.epsilon,"
        " 'lower': correct.lower_bound, 'violation': correct.violation,"
        " 'broken_lower': broken.lower_bound, 'delta': DELTA, 'noise': NOISE,"
        " 'steps': AUDIT_STEPS, 'n_audit': int(len(audit_x)), 'canaries': CANARIES,"
        " 'private_eps': private_epsilon.epsilon,"
        " 'mi': {k: [r.auc, r.tpr_at_fpr[0.001], r.tpr_at_fpr[0.01], r.members, r.non_members]"
        " for k, r in mi.items()},"
        " 'private_auc_direct': __import__('sklearn.metrics').metrics.roc_auc_score("
        "np.r_[np.ones(MI_SIZE), np.zeros(MI_SIZE)], -np.r_["
        "mi_loss.call(members[1], private.predict(members[0], verbose=0).astype('float64')).numpy(),"
        "mi_loss.call(non_members[1],"
        " private.predict(non_members[0], verbose=0).astype('float64')).numpy()])}))"
    ),
    "dp_finetuning": (
        "import json\n"
        "print(json.dumps({'data': data_name, 'n': int(n), 'batch': BATCH_SIZE,"
        " 'sigma': NOISE_MULTIPLIER, 'delta': DELTA, 'epochs': EPOCHS,"
        " 'strategies': [lora_model.optimizer.gradient_clipper.description,"
        " head_model.optimizer.gradient_clipper.description],"
        " 'steps': [lora_ledger.num_samples, head_ledger.num_samples],"
        " 'ledger_eps': [lora_result.epsilon, head_result.epsilon],"
        " 'trainable': {k: [v.path for v in m.trainable_variables] for k, m in"
        " (('lora', lora_model), ('head', head_model), ('nonprivate', nonprivate_model))},"
        " 'all_variables': len(build_classifier().trainable_variables),"
        " 'accuracy': [lora_accuracy, head_accuracy, nonprivate_accuracy],"
        " 'majority': majority, 'test_labels': [int(v) for v in y_test]}))"
    ),
    "dp_large_data": (
        "import json\n"
        "print(json.dumps({'n': int(n), 'batch': BATCH_SIZE, 'sigma': NOISE_MULTIPLIER,"
        " 'delta': DELTA, 'epochs': EPOCHS, 'records_in_files': int(sum(1 for _ in"
        " tf.data.TFRecordDataset(paths))),"
        " 'entries': [[e.sampling.population_size, e.sampling.selection_probability,"
        " e.sampling.policy] for e in"
        " tfrecord_ledger.samples()[:1] + shuffled_ledger.samples()[:1]],"
        " 'steps': [tfrecord_ledger.num_samples, memmap_model.optimizer.ledger.num_samples,"
        " shuffled_ledger.num_samples],"
        " 'eps': [tfrecord_result.epsilon, memmap_result.epsilon, shuffled_result.epsilon,"
        " declared_poisson.epsilon],"
        " 'accuracy': [float(tfrecord_accuracy), float(memmap_accuracy),"
        " float(shuffled_accuracy)]}))"
    ),
}


def _check_dp_large_data(values):
    from tf_dp.accounting import dp_sgd_epsilon

    n, b, sigma, delta, epochs = (values[k] for k in ("n", "batch", "sigma", "delta", "epochs"))
    assert values["records_in_files"] == n  # counted by TensorFlow's own reader
    poisson, shuffle = values["entries"]
    assert poisson == [n, b / n, "poisson"] and shuffle == [n, b / n, "shuffle"]
    steps = values["steps"]
    assert steps[0] == steps[1] == epochs * round(n / b)
    assert steps[2] == epochs * math.ceil(n / b)
    eps_tfrecord, eps_memmap, eps_shuffled, eps_declared = values["eps"]
    expected = dp_sgd_epsilon(n, b, sigma, delta, steps=steps[0]).epsilon
    assert math.isclose(eps_tfrecord, expected, rel_tol=1e-6)
    assert math.isclose(eps_memmap, expected, rel_tol=1e-6)
    assert math.isclose(eps_shuffled, dp_sgd_epsilon(
        n, b, sigma, delta, epochs=epochs, sampling="shuffle").epsilon, rel_tol=1e-6)
    assert eps_shuffled > 5 * eps_declared
    assert all(0.2 < a <= 1.0 for a in values["accuracy"])  # 10 classes: chance is 0.1


def _check_classification_privacy(values):
    assert 0.2 < values["accuracy"] <= 1.0  # 10 classes: chance is 0.1
    assert math.isfinite(values["epsilon"]) and 0 < values["epsilon"] <= values["budget"]
    assert values["spent"] <= values["budget"]
    eps = values["history_eps"]
    assert len(eps) >= 1 and all(b > a for a, b in zip(eps, eps[1:]))  # grows epoch by epoch
    acc = values["accountants"]
    assert acc["gdp"][1] is False and all(acc[k][1] for k in ("rdp", "moments", "pld"))
    assert acc["pld"][0] <= acc["rdp"][0] <= acc["moments"][0]
    sweep = values["sweep"]
    assert [s for s, _, _ in sweep] == sorted(s for s, _, _ in sweep)
    epsilons = [e for _, e, _ in sweep]
    assert all(b < a for a, b in zip(epsilons, epsilons[1:]))  # more noise, smaller epsilon
    assert all(0.1 < a <= 1.0 for _, _, a in sweep)
    assert values["baseline"] > 0.2


def _check_privacy_accounting(values):
    from scipy import stats

    from tf_dp.accounting import dp_sgd_epsilon

    table = values["table"]
    assert len(table) == 6
    for i, row in enumerate(table):
        # Table 1 of Bu et al. 2019: mu and the CLT epsilon to the printed precision.
        assert abs(row["mu"] - row["paper_mu"]) <= 0.006
        assert abs(row["gdp"] - row["paper_clt"]) <= 0.006
        if i < 3:  # the moments accountant reproduces the first three rows
            assert abs(row["moments"] - row["paper_ma"]) <= 0.006
        assert 0 < row["pld"] <= row["rdp"] <= row["moments"] < math.inf
    for name, curve in values["curves"].items():
        assert all(b > a for a, b in zip(curve, curve[1:])), name
    mu = table[1]["mu"]
    errors = values["min_error"]
    assert abs(errors["GDP (approximation)"] - 2 * stats.norm.cdf(-mu / 2)) < 2e-3
    assert 0.7 < errors["PLD bound (certified)"] < 0.8
    assert 0.05 < errors["moments accountant (eps, delta)"] < 0.15  # the paper's 9.4%
    for row in values["sampling"]:
        assert row["shuffle pld"] > 10 * row["poisson pld"]
        assert row["poisson pld"] <= row["poisson rdp"]
    for name, sigma in values["calibrated"].items():
        eps = dp_sgd_epsilon(60000, 256, sigma, 1e-5, epochs=values["epochs"], accountant=name)
        assert values["target"] * 0.99 <= eps.epsilon <= values["target"]


def _check_custom_layers_and_ghost_clipping(values):
    from tf_dp.accounting import dp_sgd_epsilon

    choices = values["choices"]
    assert choices["plain_model"].startswith("ghost") and "vectorized" not in choices["plain_model"]
    assert "ghost+vectorized (layers: low_rank_dense" in choices["mixed_model"]
    assert choices["custom_only_model"] == "vectorized"
    # The registered rule is exact (float32 rounding) against the per-example loop.
    assert max(values["rule"]) < 1e-4 and values["per_layer_error"] < 1e-4
    # Dividing grad_output by B scales every norm of the custom layer by 1/B: relative error
    # 1 - 1/B on those variables (the Dense layer's norms are untouched).
    assert abs(values["mistaken"][0] - (1 - 1 / values["check_batch"])) < 1e-3
    assert values["mistaken"][1] > 1e-2
    assert values["clipper"] == "ghost"
    # Eq. (1) of McMahan et al. 2018, from the clips and stddevs the notebook chose.
    z = sum((c / s) ** 2 for c, s in zip(values["clips"], values["stddevs"])) ** -0.5
    assert math.isclose(z, values["z"], rel_tol=1e-6)
    assert all(math.isclose(e, z, rel_tol=1e-5) for e in values["effective"])
    assert len(values["effective"]) == values["steps"]
    flat = dp_sgd_epsilon(values["n"], values["batch"], z, values["delta"], steps=values["steps"],
                          accountant="pld")
    assert math.isclose(values["epsilon"], flat.epsilon, rel_tol=1e-3)
    assert all(0.2 < a <= 1.0 for a in values["accuracy"])  # 10 classes: chance is 0.1


def _check_migrating_from_tf_privacy(values):
    from scipy import optimize, stats

    from tf_dp.accounting import dp_sgd_epsilon

    n, batch, sigma, epochs, delta = (values[k] for k in ("n", "batch", "sigma", "epochs", "delta"))
    assert values["steps"] == [epochs * math.ceil(n / batch), epochs * round(n / batch)]
    for name in ("rdp", "pld"):
        independent = dp_sgd_epsilon(n, batch, sigma, delta, epochs=epochs, accountant=name)
        assert math.isclose(values["cli"][name]["epsilon"], independent.epsilon, rel_tol=1e-6)
        # The Poisson run's ledger gives what the hyperparameters give.
        assert math.isclose(values["poisson"][name]["epsilon"], independent.epsilon, rel_tol=1e-3)
    for out in (values["cli"], values["poisson"], values["shuffle"]):
        assert out["rdp"]["certified"] and out["pld"]["certified"]
    assert values["cli"]["gdp"]["certified"] is False
    assert values["poisson"]["gdp"]["certified"] is False
    # Shuffle without amplification: E epochs of a full-batch Gaussian with noise sigma/2
    # (replace-one, sensitivity 2C) is exactly mu-GDP with mu = 2 sqrt(E) / sigma (Dong, Roth, Su).
    mu = 2 * math.sqrt(epochs) / sigma

    def gdp_delta(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)

    exact = optimize.brentq(lambda e: gdp_delta(e) - delta, 1e-6, 200, xtol=1e-10)
    assert math.isclose(values["shuffle"]["gdp"]["epsilon"], exact, rel_tol=1e-4)
    assert values["shuffle"]["gdp"]["certified"] is True
    assert exact * (1 - 1e-4) <= values["shuffle"]["pld"]["epsilon"] <= exact * 1.02
    assert values["shuffle"]["pld"]["epsilon"] > 5 * values["poisson"]["pld"]["epsilon"]
    # Microbatches: sensitivity 2C, i.e. the effective noise multiplier is halved.
    halved = dp_sgd_epsilon(n, batch, sigma / 2, delta, epochs=epochs, accountant="rdp")
    assert math.isclose(values["microbatch"]["rdp"]["epsilon"], halved.epsilon, rel_tol=1e-6)
    assert all(0.2 < a <= 1.0 for a in values["accuracy"])  # 10 classes: chance is 0.1


def _check_text_classification(values):
    from tf_dp.accounting import dp_sgd_epsilon, jl_epsilon

    # The test points the notebook at Debian's fortunes: the output must say it is the fallback.
    assert values["data"].startswith("fortunes") and "FALLBACK" in values["data"]
    labels = values["test_labels"]
    shares = [labels.count(c) / len(labels) for c in range(values["classes"])]
    assert abs(values["majority"] - max(shares)) < 1e-9
    n, batch, sigma, delta = values["n"], values["batch"], values["sigma"], values["delta"]
    steps_exact, steps_jl = values["steps"]
    assert steps_exact == steps_jl and steps_exact >= 1
    # The ledger of the exact run gives what the accountant gives from the hyperparameters.
    independent = dp_sgd_epsilon(n, batch, sigma, delta, steps=steps_exact, accountant="pld")
    assert math.isclose(values["ledger_eps"][0], independent.epsilon, rel_tol=1e-3)
    assert math.isclose(values["exact_eps"], independent.epsilon, rel_tol=1e-3)
    eps = values["history_eps"]
    assert all(b > a for a, b in zip(eps, eps[1:])) and math.isclose(eps[-1], independent.epsilon,
                                                                     rel_tol=1e-3)
    # JL run: the ledger's epsilon is the JL accountant's for (q, sigma, steps, r).
    jl_direct = jl_epsilon(batch / n, sigma, steps_jl, delta, values["r"])
    if math.isinf(jl_direct):
        assert math.isinf(values["ledger_eps"][1])
    else:
        assert math.isclose(values["ledger_eps"][1], jl_direct, rel_tol=0.05)
    # Epsilon vs r: never better than exact clipping (an exact-norm step is the r -> inf limit),
    # not increasing in r; heavy tail P(Z_r > z) ~ z^-r: r <= 2 has no finite bound at 1e-5;
    # by r = 64 the norm estimate's relative spread is ~1/sqrt(128) and epsilon is near exact.
    curve = {int(r): e for r, e in values["eps_vs_r"].items()}
    rs = sorted(curve)
    assert all(curve[b] <= curve[a] for a, b in zip(rs, rs[1:]))
    assert all(e >= values["exact_eps"] * (1 - 1e-3) for e in curve.values())
    assert math.isinf(curve[1]) and math.isinf(curve[2])
    assert math.isfinite(curve[64]) and curve[64] < 1.5 * values["exact_eps"]
    assert all(0.0 <= a <= 1.0 for a in values["accuracy"])


def _check_privacy_auditing(values):
    from tf_dp.accounting import dp_sgd_epsilon

    # the correct run's certificate is the accountant's for full-batch DP-SGD with that noise
    n = values["n_audit"] + values["canaries"]  # any n: q = 1
    independent = dp_sgd_epsilon(n, n, values["noise"], values["delta"], steps=values["steps"])
    assert math.isclose(values["certified"], independent.epsilon, rel_tol=0.05)
    assert 0.0 <= values["lower"] <= values["certified"] and values["violation"] is False
    assert values["broken_lower"] > 2 * values["certified"]  # noise off: caught
    for auc, tpr_low, tpr, members, non_members in values["mi"].values():
        assert 0.0 <= auc <= 1.0 and 0.0 <= tpr_low <= tpr <= 1.0 and members == non_members
    # the attack's AUC is the Mann-Whitney statistic of the losses (sklearn, from the model)
    assert math.isclose(values["mi"]["private"][0], values["private_auc_direct"], abs_tol=1e-6)
    # the non-private model leaks more than the private one; the private model's attack stays
    # within what its certificate allows at FPR 1% (TPR <= e^eps FPR + delta, with the sampling
    # error of 1000 members: 3 binomial sd <= 0.05)
    assert values["mi"]["non-private"][0] > values["mi"]["private"][0]
    assert values["mi"]["private"][2] <= math.exp(values["private_eps"]) * 0.01 + 1e-5 + 0.05


def _check_dp_finetuning(values):
    from tf_dp.accounting import dp_sgd_epsilon

    assert values["data"].startswith("fortunes") and "FALLBACK" in values["data"]
    assert "random weights" in values["data"]  # the offline model is not pretrained: said so
    labels = values["test_labels"]
    assert abs(values["majority"] - max(labels.count(c) for c in set(labels)) / len(labels)) < 1e-9
    # Every trainable variable of both private runs is covered by a ghost rule (no fallback).
    assert values["strategies"] == ["ghost", "ghost"]
    # Poisson batches: ceil(1/q) steps per epoch, where q = batch / n.
    n, batch, sigma, delta = values["n"], values["batch"], values["sigma"], values["delta"]
    steps = values["epochs"] * math.ceil(n / batch)
    assert values["steps"] == [steps, steps]
    independent = dp_sgd_epsilon(n, batch, sigma, delta, steps=steps, accountant="pld")
    for eps in values["ledger_eps"]:
        assert math.isclose(eps, independent.epsilon, rel_tol=1e-3)
    # LoRA trains the adapters (and the head), head-only only the head's variables.
    lora, head = values["trainable"]["lora"], values["trainable"]["head"]
    assert any(p.endswith("lora_kernel_a") for p in lora)
    assert not any("backbone" in p or "transformer" in p for p in head) and head
    assert len(lora) < values["all_variables"] and values["trainable"]["nonprivate"] == lora
    assert all(0.0 <= a <= 1.0 for a in values["accuracy"])


def _check_dp_user_level(values):
    from tf_dp.accounting import dp_sgd_epsilon

    steps, sigma, delta = values["steps"], values["sigma"], values["delta"]
    assert values["ledger_steps"] == [steps, steps]
    n, n_users = values["n"], values["n_users"]
    q_ex, q_user = values["q"]
    assert values["user_sampling"] == [[n_users, q_user, "user", values["k"]]]
    # each run's ledger gives what the hyperparameters give, with the users as the population
    for (pop, q), eps in zip(((n, q_ex), (n_users, q_user)), values["epsilon"]):
        independent = dp_sgd_epsilon(pop, q * pop, sigma, delta, steps=steps, accountant="pld")
        assert math.isclose(eps, independent.epsilon, rel_tol=1e-3)
    assert q_user > q_ex and values["epsilon"][1] > values["epsilon"][0]
    assert "example-level" in values["claims"][0] and "user-level" in values["claims"][1]
    assert all("sampling performed by tf_dp" in c for c in values["claims"])
    assert all(0.2 < a <= 1.0 for a in values["accuracy"])  # 10 classes: chance is 0.1


def _check_sparse_embeddings(values):
    from scipy import stats

    from tf_dp.accounting import dp_sgd_epsilon

    z, s1, s2 = values["z"], values["sigma1"], values["sigma2"]
    assert math.isclose(s1**-2 + s2**-2, z**-2, rel_tol=1e-12)
    # both runs: the Poisson-subsampled Gaussian of multiplier z, from the hyperparameters
    independent = dp_sgd_epsilon(values["n"], values["batch"], z, values["delta"],
                                 steps=values["steps"], accountant=values["accountant"]).epsilon
    for eps in list(values["epsilons"].values()) + [values["file_epsilon"]]:
        assert math.isclose(eps, independent, rel_tol=1e-6)
    assert values["file_steps"] == values["steps"]
    (c2, std2), (c1, std1) = values["queries"]  # the gradient's, then the selection's
    assert c2 == c1 == 1.0 and math.isclose(std2, s2, rel_tol=1e-6) and std1 == s1
    assert 0.6 < values["baseline"] <= values["bayes"] + 0.02  # 2 classes: chance is 0.5
    assert all(0.5 < a <= 1.0 for a in values["accuracy"].values())
    # the extra step: the untouched rows that moved are the empty rows whose noisy count passed
    # the threshold: binomial, at most 6 sigma above its mean
    untouched = set(values["moved"]) - set(values["in_batch"])
    m = values["items"] - len(values["in_batch"])
    p = stats.norm.sf(values["threshold"] / s1)
    assert len(untouched) <= m * p + 6 * math.sqrt(m * p * (1 - p)) + 1


def _check_correlated_noise(values):
    from dp_accounting.pld import privacy_loss_distribution as pld

    e, b = values["epochs"], values["bands"]
    # closed forms: C = I gives sqrt(epochs); the banded square root's columns at one record's
    # steps (b apart, b bands) have disjoint supports, each of squared norm sum_j r_j^2
    r = [math.comb(2 * j, j) / 4**j for j in range(b)]
    assert math.isclose(values["sens"]["DP-SGD"], math.sqrt(e), rel_tol=1e-12)
    assert math.isclose(values["sens"]["BandMF"], math.sqrt(e * sum(x * x for x in r)),
                        rel_tol=1e-12)
    for name in ("DP-SGD", "BandMF"):
        # dp_accounting's PLD of the Gaussian mechanism (pessimistic: at or a little above)
        eps = pld.from_gaussian_mechanism(
            values["sigmas"][name], sensitivity=values["sens"][name], value_discretization_interval=1e-4
        ).get_epsilon_for_delta(values["delta"])
        assert values["target"] * (1 - 1e-6) <= eps <= values["target"] * 1.01, (name, eps)
    assert values["resumed_step"] == values["parts"]  # one epoch of b steps before the save
    assert all(0.2 < a <= 1.0 for a in values["accuracy"].values())  # chance is 0.1


VALIDATORS = {
    "sparse_embeddings": _check_sparse_embeddings,
    "correlated_noise": _check_correlated_noise,
    "dp_user_level": _check_dp_user_level,
    "privacy_auditing": _check_privacy_auditing,
    "dp_finetuning": _check_dp_finetuning,
    "dp_large_data": _check_dp_large_data,
    "classification_privacy": _check_classification_privacy,
    "privacy_accounting": _check_privacy_accounting,
    "custom_layers_and_ghost_clipping": _check_custom_layers_and_ghost_clipping,
    "migrating_from_tf_privacy": _check_migrating_from_tf_privacy,
    "text_classification": _check_text_classification,
}


def test_every_notebook_has_a_source_and_is_up_to_date():
    assert NAMES, "no notebook in tutorials/"
    assert set(NAMES) == set(builder.available())
    for name in NAMES:
        expected = nbformat.writes(builder.build(name))
        with open(builder.notebook_path(name), encoding="utf-8") as f:
            stored = f.read()
        assert stored.rstrip("\n") == expected.rstrip("\n"), (
            f"{name}.ipynb differs from tutorials/_nb_{name}.py: run "
            "python tutorials/_build_notebooks.py"
        )


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_without_outputs(name):
    nb = nbformat.read(builder.notebook_path(name), as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}: a code cell has outputs"
            assert cell.execution_count is None, f"{name}: a code cell has an execution count"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_opens_with_its_colab_badge_and_has_the_set_up_cell(name):
    nb = nbformat.read(builder.notebook_path(name), as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown"
    url = colab.colab_url(f"{name}.ipynb")
    assert url.startswith(f"https://colab.research.google.com/github/{colab.GITHUB_REPOSITORY}/")
    assert url.endswith(f"/blob/{colab.BRANCH}/tutorials/{name}.ipynb")
    assert first.source == colab.badge_markdown(f"{name}.ipynb")
    setup = [c for c in nb.cells if c.cell_type == "code" and "find_spec(\"tf_dp\")" in c.source]
    assert len(setup) == 1, f"{name}: no set-up cell"
    assert colab.pip_requirement() in setup[0].source
    assert colab.REPOSITORY_URL in setup[0].source
    # The set-up cell comes before any other code.
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    assert first_code is setup[0]
    # A parameters cell reads the small-size switch.
    assert any("TF_DP_TUTORIAL_SMALL" in c.source and "parameters" in c.metadata.get("tags", [])
               for c in nb.cells if c.cell_type == "code")


@pytest.fixture(scope="module")
def data_dir():
    # README's test command installs Debian's dataset-fashion-mnist; the notebooks' small mode
    # and checks are sized for it (with scikit-learn's digits as a stand-in, two of them failed)
    assert os.path.isfile(os.path.join(DEBIAN_FASHION_MNIST, "train-labels-idx1-ubyte.gz")), (
        f"no Fashion-MNIST in {DEBIAN_FASHION_MNIST}: run README's test command, which installs "
        "Debian's dataset-fashion-mnist package"
    )
    return DEBIAN_FASHION_MNIST


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom_in_small_mode(name, data_dir, tmp_path, monkeypatch):
    nb = nbformat.read(builder.notebook_path(name), as_version=4)
    check = CHECKS.get(name)
    if check is not None:
        nb.cells.append(nbformat.v4.new_code_cell(check))
    monkeypatch.setenv("TF_DP_TUTORIAL_SMALL", "1")
    monkeypatch.setenv("TF_DP_TUTORIAL_DATA_DIR", data_dir)
    if name in ("text_classification", "dp_finetuning"):
        # README's test command installs Debian's fortunes (the offline text corpus)
        assert os.path.isfile(os.path.join(DEBIAN_FORTUNES, "computers")), (
            f"no text corpus in {DEBIAN_FORTUNES}: run README's test command, which installs "
            "Debian's fortunes package"
        )
        monkeypatch.setenv("TF_DP_TUTORIAL_TEXT_DATA_DIR", DEBIAN_FORTUNES)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    if check is None:
        return
    outputs = nb.cells[-1].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    values = json.loads(text.strip().splitlines()[-1])
    VALIDATORS[name](values)
