"""Ablation of the ghost step by piece, same process: non-private, ghost, ghost without noise,
ghost with the first / second / both convolution norm rules replaced by a free stand-in, without
the ledger. Research only: the stand-in variants are not private and clip nothing correctly.

    python -m research.ghost.ablate_rules cnn
"""
import sys, time, statistics, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf, keras
from bench import step_time as st
from tf_dp.dp_query import gaussian_query as gq
from tf_dp.gradients.ghost import rules as R
from tf_dp.gradients.ghost.factors import PerExample
model_name = sys.argv[1] if len(sys.argv) > 1 else "cnn"
ds = st.dataset(model_name, 256)
def zero_noise(gen, values, sds): return values
def cheap_conv(layer, inputs, g):
    B = tf.shape(g)[0]
    out = [(layer.kernel, PerExample(tf.zeros([B] + list(layer.kernel.shape)) + tf.reduce_sum(g) * 0))]
    if layer.bias is not None: out.append((layer.bias, R._bias_per_example(g, layer.bias)))
    return out

def cheap_first_conv(layer, inputs, g):
    if layer.kernel.shape[2] == 1: return cheap_conv(layer, inputs, g)
    return R.conv_rule(layer, inputs, g)
def cheap_second_conv(layer, inputs, g):
    if layer.kernel.shape[2] != 1: return cheap_conv(layer, inputs, g)
    return R.conv_rule(layer, inputs, g)
variants = {}
from tf_dp.ledger import query_with_ledger as QL
def no_ledger(self, sample_state, global_state):
    return self._query.get_noised_result(sample_state, global_state)
def build(name, mode, noise=None, conv=None, ledger=True):
    oldn, oldc = gq.add_gaussian_noise_structure, R._RULES[keras.layers.Conv2D]
    oldl = QL.QueryWithLedger.get_noised_result
    if not ledger: QL.QueryWithLedger.get_noised_result = no_ledger
    if noise: gq.add_gaussian_noise_structure = noise
    if conv: R._RULES[keras.layers.Conv2D] = R.RuleEntry(keras.layers.Conv2D, conv, R._conv_supports, True)
    try:
        m = st.build(model_name, mode, 256); st.warm_up(m, ds, 5)
    finally:
        gq.add_gaussian_noise_structure = oldn; R._RULES[keras.layers.Conv2D] = oldc
        QL.QueryWithLedger.get_noised_result = oldl
    variants[name] = (m, iter(ds))
build("nonprivate", "nonprivate")
build("ghost", "ghost")
build("ghost no noise", "ghost", noise=zero_noise)
if model_name == "cnn":
    build("ghost cheap conv1", "ghost", conv=cheap_first_conv)
    build("ghost cheap conv2", "ghost", conv=cheap_second_conv)
    build("ghost cheap convs", "ghost", conv=cheap_conv)
    build("cheap convs no noise no ledger", "ghost", conv=cheap_conv, noise=zero_noise, ledger=False)
build("ghost no ledger", "ghost", ledger=False)
times = {k: [] for k in variants}
for _ in range(5):
    for k, (m, it) in variants.items():
        st._sync(m.train_function(it))
        for _ in range(10):
            t = time.perf_counter(); st._sync(m.train_function(it)); times[k].append(time.perf_counter() - t)
b = statistics.median(times["nonprivate"])
for k in variants:
    t = statistics.median(times[k]); print(f"{k:20s} {t*1e3:6.2f} ms {t/b:.2f}x")
