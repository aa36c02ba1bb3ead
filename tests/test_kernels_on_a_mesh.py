"""Kernels are single-device ops that the parallel runtime maps: the Pallas gated gather run by
`own_tokens.on_own_tokens` on a mesh (each device on its own tokens, every axis manual) equals the op on one device."""

import jax
import ml_collections
import numpy as np
import pytest
from kernel_cases import gather_case, value_and_grads

from sparsetx.config import DEFAULT_RULES
from sparsetx.kernels.rows.gated_gather import KernelOptions, gated_gather
from sparsetx.models.ffn.common import ACTIVATIONS
from sparsetx.parallel import logical_rules
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.parallel.own_tokens import on_own_tokens


@pytest.mark.parametrize("ici", [dict(data=8), dict(data=2, fsdp=2, tensor=2)])
def test_pallas_gated_gather_on_a_mesh_equals_one_device(ici):
  """Loss and every gradient (x, both tables, gates, bias) agree; the kernels ran in a shard_map manual over every
  mesh axis (the table gradients summed over the devices by its transpose)."""
  x, w_in, w_out, rows, gates, bias = gather_case(11, 8, 4, 2, 2, 5, 16)
  options = KernelOptions("triton", block_tokens=4, interpret=True)
  fn = lambda *a: gated_gather(*a[:5], ACTIVATIONS["gelu"], a[5], options)  # noqa: E731
  expected = value_and_grads(fn, x, w_in, w_out, rows, gates, bias)
  B, T = x.shape[:2]

  def mapped(x, w_in, w_out, rows, gates, bias):
    flat = [a.reshape((B * T,) + a.shape[2:]) for a in (x, rows, gates)]
    local = lambda x_n, rows_n, gates_n, *tables: (
      fn(x_n[None], *tables[:2], rows_n[None], gates_n[None], tables[2])[0],
    )  # noqa: E731
    (y,) = on_own_tokens(local, flat, (w_in, w_out, bias), ((None, None), (None, None), (None,)))
    return y.reshape(x.shape)

  mesh_config = ml_collections.ConfigDict(
    dict(ici={**dict(data=1, fsdp=1, tensor=1, expert=1), **ici}, dcn=dict(data=1, fsdp=1, tensor=1, expert=1))
  )
  mesh = mesh_lib.make_mesh(mesh_config, jax.devices()[:8])
  with logical_rules.activate(mesh, DEFAULT_RULES):
    jaxpr = jax.make_jaxpr(mapped)(x, w_in, w_out, rows, gates, bias)
    got = value_and_grads(mapped, x, w_in, w_out, rows, gates, bias)
  (shard_map,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
  assert set(shard_map.params["newly_manual_axes"]) == set(mesh.axis_names)
  assert "pallas_call" in str(shard_map.params["jaxpr"])
  # the loss sums x.size terms of |sin| <= 1, in another order over the shards: eps per term at most
  np.testing.assert_allclose(got[0], expected[0], rtol=0, atol=x.size * np.finfo(np.float32).eps)
  for name, a, b in zip(("x", "w_in", "w_out", "gates", "bias"), got[1], expected[1]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)  # float32 sums in another order
