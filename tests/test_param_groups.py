"""Per-group gradient and update norms (sparsetx/train/param_groups.py): every parameter of every type lands in the
group its role says, and the groups' norms make up the global norm."""

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


HAND_TREE = {  # a gradient tree's paths as the models name them (sgatlin, a dense MLP), each with its group by hand
  "embed/embedding": ("embeddings", (7, 4)),
  "layers_0/attention_norm/scale": ("norms", (4,)),
  "layers_0/attention/query/kernel": ("attention", (4, 2, 2)),
  "layers_0/attention/out/kernel": ("attention", (2, 2, 4)),
  "layers_0/mlp_norm/scale": ("norms", (4,)),
  "layers_0/mlp/router/query/kernel": ("routers", (4, 3)),
  "layers_0/mlp/router/keys/kernel": ("routers", (3, 2, 2, 2)),
  "layers_0/mlp/experts": ("tables", (2, 2, 4, 4)),
  "layers_1/mlp/wi/kernel": ("tables", (4, 8)),
  "layers_1/mlp/wo/bias": ("tables", (4,)),
  "final_norm/scale": ("norms", (4,)),
  "final_norm/bias": ("norms", (4,)),
  "lm_head/kernel": ("embeddings", (4, 7)),
}


def test_the_groups_norms_are_their_members_and_make_up_the_global_norm():
  """Each group's norm is that of the leaves listed for it by hand (in float64), and the groups' squares add up to
  optax's global norm squared, both within the float32 rounding of a sum of squares."""
  rng = np.random.default_rng(0)
  tree, members = {}, {}
  for name, (group, shape) in HAND_TREE.items():
    leaf = rng.standard_normal(shape).astype(np.float32)
    *parents, last = name.split("/")
    node = tree
    for part in parents:
      node = node.setdefault(part, {})
    node[last] = leaf
    members.setdefault(group, []).append(leaf.astype(np.float64).ravel())
  unit = float(np.finfo(np.float32).eps) / 2  # a float32 rounding
  norms = param_groups.group_norms(tree)
  assert set(norms) == set(members) == set(param_groups.GROUPS)
  for group, leaves in members.items():
    values = np.concatenate(leaves)
    # n squares and n - 1 additions in float32 (any order): relative error of the sum at most (n + 1) u, of its
    # square root half that, plus the root's own rounding.
    want = float(np.sqrt(np.sum(values**2)))
    assert float(norms[group]) == pytest.approx(want, rel=((values.size + 1) / 2 + 1) * unit), group
  n = sum(int(np.prod(shape)) for _, shape in HAND_TREE.values())
  # Each side is a float32 sum of the n squares, squared back from a float32 norm: at most (n + 3) u from the exact sum.
  assert sum(float(v) ** 2 for v in norms.values()) == pytest.approx(
    float(optax.tree.norm(tree)) ** 2, rel=2 * (n + 3) * unit
  )
