"""bench_layers' "Listing 1" row runs the sgatlin layer with `kernel.implementation=reference` (the paper's gather and
einsums in place of the gated gather op), and its MoE rollout row runs MoE with `jax.lax.ragged_dot` in place of the
grouped-matmul kernels. Both variants of a tiny layer are built by the tool's own `Variant`: the reference form must be
the one that runs (the reference function is called while tracing) and give the op's output; and the table-gradient
table prints both row distributions. Runs in a fresh process, since the tool defines absl flags that other programs
define too.
"""

import os
import subprocess
import sys

from conftest import REPO

CHECK = r"""
import numpy as np

from sparsetx.kernels.rows import gated_gather
from sparsetx.kernels.grouped_matmul import op
from sparsetx.models.ffn.sgatlin import Sgatlin
from sparsetx.tools import bench_layers

calls = []
def counting(fn):
  def wrapped(*args, **kwargs):
    calls.append(fn.__name__)
    return fn(*args, **kwargs)
  return wrapped

gated_gather.gated_gather_reference = counting(gated_gather.gated_gather_reference)
op.ragged_dot = counting(op.ragged_dot)

cfg = bench_layers.layer_config(32, "float32", type="sgatlin", d_ffw=16**2, n_channels=2, top_k=4, d_key=16)
op = bench_layers.Variant("op", Sgatlin(cfg), 32, 256, "float32")
assert not calls, calls
papers_cfg = bench_layers.layer_config(32, "float32", True, type="sgatlin", d_ffw=16**2, n_channels=2, top_k=4, d_key=16)
papers = bench_layers.Variant("listing 1", Sgatlin(papers_cfg), 32, 256, "float32")
assert "gated_gather_reference" in calls, "the Listing 1 variant never called the paper's gather"
y_op, y_papers = op.steps["fwd"](*op.args), papers.steps["fwd"](*papers.args)
# Same parameters and input (same keys); float32 sums of 8 picked rows of 32 values: equal to rounding.
np.testing.assert_allclose(np.asarray(y_papers), np.asarray(y_op), rtol=1e-5, atol=1e-5)

moe = dict(type="moe", d_ffw=32, n_experts=4, experts_per_token=2)
grouped = bench_layers.Variant("grouped", bench_layers.moe.Moe(bench_layers.layer_config(32, "float32", **moe)), 32, 256, "float32")
assert "ragged_dot" not in calls, calls
rollout_cfg = bench_layers.layer_config(32, "float32", True, **moe)
dense = bench_layers.Variant("rollout", bench_layers.moe.Moe(rollout_cfg), 32, 256, "float32")
assert "ragged_dot" in calls, "the rollout variant never called ragged_dot"
# float32 sums of 32 products per matmul, three matmuls: equal to rounding.
y_grouped, y_dense = grouped.steps["fwd"](*grouped.args), dense.steps["fwd"](*dense.args)
np.testing.assert_allclose(np.asarray(y_dense), np.asarray(y_grouped), rtol=1e-5, atol=1e-5)

bench_layers.table_grads_table(1, 256, "float32", 1, 0.6, [0, 4])
print("ok")
"""


def test_reference_variants_run_the_replaced_forms_and_match_the_ops():
  env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
  assert "uniform" in result.stdout and "skewed" in result.stdout and "busiest program" in result.stdout
