"""The public API resolves where users expect it, and the accounting side stays TensorFlow-free."""

import subprocess
import sys

import tf_dp


def test_every_top_level_export_resolves():
    missing = [name for name in tf_dp.__all__ if not hasattr(tf_dp, name)]
    assert not missing
    import tf_dp.accounting as accounting
    import tf_dp.keras as dpk

    for module in (dpk, accounting, tf_dp.dp_query, tf_dp.gradients):
        assert [n for n in module.__all__ if not hasattr(module, n)] == [], module.__name__
    assert tf_dp.GaussianSumQuery is tf_dp.dp_query.GaussianSumQuery
    assert tf_dp.PrivacyReport is dpk.callbacks.PrivacyReport


def test_accounting_and_ledger_files_do_not_import_tensorflow():
    code = (
        "import sys, tf_dp, tf_dp.accounting, tf_dp.ledger.ledger_file, tf_dp.ledger.journal, "
        "tf_dp.cli._common; "
        "print('tensorflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
