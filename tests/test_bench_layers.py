"""bench_layers' "Listing 1" row runs the sgatlin layer with the paper's gather in place of the gated gather op, and
its MoE rollout row runs MoE with `jax.lax.ragged_dot` in place of the grouped-matmul kernels.

The tool swaps the function the layer calls (`sparsetx.parallel.dispatch.gated_gather`); when the layer's call path
moved, the swap's target disappeared and the tool crashed before printing anything. Here both variants of a tiny
layer are built by the tool's own `Variant`: the swap must take effect (the paper's gather is called) and give the
op's output. Runs in a fresh process, since the tool defines absl flags that other programs define too.
"""

import os
import subprocess
import sys

from conftest import REPO

CHECK = r"""
from unittest import mock

import numpy as np

from sparsetx.models.ffn.sgatlin import Sgatlin
from sparsetx.tools import bench_layers

calls = []
listing_1 = bench_layers.papers_gather


def counted(*args, **kwargs):
  calls.append(1)
  return listing_1(*args, **kwargs)


cfg = bench_layers.layer_config(32, "float32", type="sgatlin", d_ffw=16**2, n_channels=2, top_k=4, d_key=16)
op = bench_layers.Variant("op", Sgatlin(cfg), 32, 256, "float32")
with mock.patch.object(bench_layers, "papers_gather", counted):
  papers = bench_layers.Variant("listing 1", Sgatlin(cfg), 32, 256, "float32", papers=True)
assert calls, "the Listing 1 variant never called the paper's gather"
y_op, y_papers = op.steps["fwd"](*op.args), papers.steps["fwd"](*papers.args)
# Same parameters and input (same keys); float32 sums of 8 picked rows of 32 values: equal to rounding.
np.testing.assert_allclose(np.asarray(y_papers), np.asarray(y_op), rtol=1e-5, atol=1e-5)

rolled = []
ragged_dot = bench_layers.rolled_out
with mock.patch.object(bench_layers, "rolled_out", lambda *a, **k: rolled.append(1) or ragged_dot(*a, **k)):
  cfg = bench_layers.layer_config(32, "float32", type="moe", d_ffw=32, n_experts=4, experts_per_token=2)
  grouped = bench_layers.Variant("grouped", bench_layers.moe.Moe(cfg), 32, 256, "float32")
  dense = bench_layers.Variant("rollout", bench_layers.moe.Moe(cfg), 32, 256, "float32", rollout=True)
assert rolled, "the rollout variant never called ragged_dot"
# float32 sums of 32 products per matmul, three matmuls: equal to rounding.
y_grouped, y_dense = grouped.steps["fwd"](*grouped.args), dense.steps["fwd"](*dense.args)
np.testing.assert_allclose(np.asarray(y_dense), np.asarray(y_grouped), rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_listing_1_and_rollout_variants_swap_the_layers_op_and_match_it():
  env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
