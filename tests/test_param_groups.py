"""Per-group gradient and update norms (sparsetx/train/param_groups.py): every parameter of every type lands in the
group its role says, and the groups' norms make up the global norm."""

import jax
import numpy as np
import optax
import pytest
from test_train import micro_config

from sparsetx.hf import lazy_tensors
from sparsetx.train import param_groups

ROLES = {  # each type's first layer, by hand
  "sgatlin": {"mlp/experts": "tables", "mlp/router/keys/kernel": "routers", "mlp/router/query/kernel": "routers"},
  "peer": {"mlp/experts": "tables", "mlp/router/query/kernel": "routers", "mlp/router/sub_keys": "routers"},
  "moe": {"mlp/router/bias": "routers", "mlp/router/kernel": "routers", "mlp/wi_gate": "tables", "mlp/wo": "tables"},
  "fff": {"mlp/b_in": "tables", "mlp/w_in": "tables", "mlp/w_out": "tables"},
}


@pytest.mark.parametrize("ffn_type", list(ROLES))
def test_each_parameter_lands_in_its_roles_group(ffn_type):
  shapes = lazy_tensors.param_shapes(micro_config(ffn_type).model)
  groups = {"/".join(path): param_groups.group_of(path) for path in shapes}
  for name, group in ROLES[ffn_type].items():
    assert groups[f"layers_0/{name}"] == group, name
  for name in ("attention/query/kernel", "attention/out/kernel"):
    assert groups[f"layers_0/{name}"] == "attention"
  assert groups["layers_0/attention_norm/scale"] == groups["final_norm/scale"] == "norms"
  assert groups["embed/embedding"] == groups["lm_head/kernel"] == "embeddings"
  assert set(groups.values()) == set(param_groups.GROUPS) - ({"routers"} if ffn_type == "fff" else set())  # hard-routed


def test_the_groups_norms_make_up_the_global_norm():
  shapes = lazy_tensors.param_shapes(micro_config("sgatlin").model)
  rng = np.random.default_rng(0)
  tree = {}
  for path, shape in shapes.items():
    node = tree
    for part in path[:-1]:
      node = node.setdefault(part, {})
    node[path[-1]] = rng.standard_normal(shape).astype(np.float32)
  norms = param_groups.group_norms(tree)
  total = float(optax.tree.norm(tree))
  assert np.sqrt(sum(float(n) ** 2 for n in norms.values())) == pytest.approx(total, rel=1e-5)
  tables = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree) if "experts" in jax.tree_util.keystr(path)]
  assert float(norms["tables"]) == pytest.approx(
    float(np.sqrt(sum((t.astype(np.float64) ** 2).sum() for t in tables))), rel=1e-5
  )
