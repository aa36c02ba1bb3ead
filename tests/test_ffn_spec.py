"""Every feed-forward type has a complete FfnSpec, and what the spec says holds for the layer it describes.

The spec is the single source of per-type knowledge (sparsetx/models/ffn/spec.py): these tests tie each of its
fields to the thing it stands for (the config's check, the module's parameters and taps, the standard names,
the PyTorch mirror class), so a spec cannot drift from its layer.
"""

import ast
import dataclasses
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import layer_model_config

from sparsetx import config as config_lib
from sparsetx.config import ffn_checks
from sparsetx.interp import names as names_lib
from sparsetx.models import ladder
from sparsetx.models.ffn.registry import SPECS, make_ffn
from sparsetx.models.ffn.spec import FfnSpec

MODELING = pathlib.Path(__file__).resolve().parent.parent / "sparsetx/hf/modeling/modeling_sparsetx.py"
REQUIRED = ("name", "module", "fields", "check", "params", "flops", "ladder_size", "served_names", "torch_class")

# A small valid layer of each type (and the variants whose accounting differs).
SMALL = {
  "mlp": [dict(d_ffw=48)],
  "swiglu": [dict(d_ffw=48)],
  "moe": [
    dict(d_ffw=16, n_experts=4, experts_per_token=2),
    dict(
      d_ffw=16, n_experts=4, experts_per_token=2, bias_update_rate=0.001, n_shared_experts=2, router_scores="sigmoid"
    ),
  ],
  "peer": [
    dict(d_ffw=36, n_channels=2, top_k=2, d_key=8),
    dict(d_ffw=36, n_channels=2, top_k=2, d_key=8, bias_update_rate=0.001),
  ],
  "sgatlin": [
    dict(d_ffw=36, n_channels=2, top_k=2, d_key=8),
    dict(d_ffw=36, n_channels=2, top_k=2, d_key=8, router="peer"),
    dict(d_ffw=36, n_channels=2, top_k=2, d_key=8, router="peer", bias_update_rate=0.001),
  ],
  "fff": [dict(depth=2, n_trees=3)],
}
CASES = [(kind, fields, bias) for kind, variants in SMALL.items() for fields in variants for bias in (False, True)]


def small_model(kind, fields, use_bias=False):
  model = layer_model_config(kind, d_model=16, **fields).as_configdict()
  model.use_bias = use_bias
  return ml_collections.FrozenConfigDict(model)


def boxed_params(model):
  x_BTD = jnp.zeros((1, 4, model.d_model), jnp.float32)
  return jax.eval_shape(make_ffn(model, name="mlp").init, jax.random.key(0), x_BTD)["params"]


def test_every_config_type_has_a_spec_in_the_same_order():
  assert tuple(SPECS) == config_lib.FFN_TYPES
  assert set(SMALL) == set(config_lib.FFN_TYPES)  # a new type gets a small case here
  for name, spec in SPECS.items():
    assert isinstance(spec, FfnSpec) and spec.name == name


@pytest.mark.parametrize("kind", config_lib.FFN_TYPES)
def test_spec_fields_are_set(kind):
  spec = SPECS[kind]
  for field in REQUIRED:
    assert getattr(spec, field) is not None, f"{kind}: FfnSpec.{field} is unset"
  assert issubclass(spec.module, nn.Module)
  defaults = config_lib.ffn_defaults()
  assert spec.fields and all(field in defaults for field in spec.fields)
  assert set(spec.ladder_size(256)) <= set(spec.fields)
  if spec.sparse:  # a sparse type says how its table is placed and how its circuit is read
    assert spec.units is not None or spec.neuron_table is not None
    assert spec.circuit.units in spec.served_names and spec.circuit.size is not None
    if spec.units is not None:
      assert spec.units.name in spec.units.table_axes and spec.units.field in spec.fields
  else:
    assert spec.units is None and spec.neuron_table is None and spec.usage_stats is None


@pytest.mark.parametrize("kind", config_lib.FFN_TYPES)
def test_spec_check_is_the_one_validation_uses(kind, monkeypatch):
  spec = SPECS[kind]
  assert spec.check is ffn_checks.FFN_CHECKS[kind]
  seen = []
  monkeypatch.setitem(ffn_checks.FFN_CHECKS, kind, lambda ffn, d_model, prefix: seen.append((ffn.type, prefix)))
  config = config_lib.default_config()
  config.model.ffn.type = kind
  config_lib.validate_ffn(config.model.ffn, config.model.d_model)
  assert seen == [(kind, "config.model.ffn")]


@pytest.mark.parametrize("kind", config_lib.FFN_TYPES)
def test_spec_check_refuses_a_bad_field_by_name(kind):
  ffn = config_lib.ffn_defaults()
  ffn.type = kind
  field = "d_ffw" if "d_ffw" in SPECS[kind].fields else "n_trees"
  ffn[field] = -1
  with pytest.raises(config_lib.ConfigError, match=f"config.model.ffn.{field}="):
    SPECS[kind].check(ffn, 64, "config.model.ffn")


def _modeling_ffn_layers() -> dict:
  """modeling_sparsetx.FFN_LAYERS as {type: class name}, and the classes the file defines (read, not imported:
  the file ships standalone with exports and needs torch)."""
  tree = ast.parse(MODELING.read_text())
  classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FFN_LAYERS" for t in node.targets):
      layers = {key.value: value.id for key, value in zip(node.value.keys, node.value.values)}
      return layers, classes
  raise AssertionError("modeling_sparsetx.py defines no FFN_LAYERS dict")


def test_torch_class_is_the_modeling_files_class_for_the_type():
  layers, classes = _modeling_ffn_layers()
  assert set(layers) == set(SPECS)
  for name, spec in SPECS.items():
    assert layers[name] == spec.torch_class and spec.torch_class in classes


@pytest.mark.parametrize("kind,fields,bias", CASES)
def test_parameter_count_equals_the_initialized_module(kind, fields, bias):
  model = small_model(kind, fields, bias)
  params = boxed_params(model)
  actual = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nn.unbox(params)))
  total, active = SPECS[kind].params(model, model.ffn)
  assert total == actual
  assert 0 < active <= total
  assert SPECS[kind].flops(model, model.ffn) == ladder.ffn_flops(model, model.ffn) > 0


@pytest.mark.parametrize("kind", [k for k, spec in SPECS.items() if spec.units or spec.neuron_table])
def test_unit_layouts_are_the_modules_table_axes(kind):
  spec = SPECS[kind]
  model = small_model(kind, SMALL[kind][0])
  boxed = jax.tree.leaves(boxed_params(model), is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  axes = {tuple(leaf.names): leaf.value.shape for leaf in boxed if isinstance(leaf, nn.LogicallyPartitioned)}
  if spec.units is not None:
    shape = axes[tuple(spec.units.table_axes)]
    assert shape[spec.units.table_axes.index(spec.units.name)] == model.ffn[spec.units.field]
  if spec.neuron_table is not None:
    assert axes[tuple(spec.neuron_table)][-1] == model.d_model


@pytest.mark.parametrize("kind", [k for k, spec in SPECS.items() if spec.sparse])
def test_circuit_taps_index_the_circuit_space(kind):
  spec = SPECS[kind]
  model = small_model(kind, SMALL[kind][0])
  layer = make_ffn(model, name="mlp")
  x_BTD = jax.random.normal(jax.random.key(1), (2, 8, model.d_model), jnp.float32)
  variables = layer.init(jax.random.key(0), x_BTD)
  _, state = layer.apply(variables, x_BTD, mutable=["intermediates"])
  taps = state["intermediates"]
  units, weights = np.asarray(taps[spec.circuit.units][0]), np.asarray(taps[spec.circuit.weights][0])
  assert units.shape == weights.shape and units.shape[:2] == (2, 8)
  ids = np.asarray(spec.circuit.ids(model.ffn, units))
  size = spec.circuit.size(model.ffn)
  assert ids.shape[:2] == (2, 8) and ids.min() >= 0 and ids.max() < size
  if spec.circuit.block is not None:  # group g's ids fall in its own block
    block = spec.circuit.block(model.ffn)
    groups = units.shape[-2]
    assert groups * block == size
    assert np.all(ids.reshape(units.shape) // block == np.arange(groups)[:, None])
  assert spec.circuit.usage_units(model.ffn) <= size


@pytest.mark.parametrize("kind", config_lib.FFN_TYPES)
def test_served_names_are_what_interp_serves(kind):
  spec = SPECS[kind]
  model = small_model(kind, SMALL[kind][0])
  typed = {entry.name for entry in names_lib.REGISTRY if entry.ffn_types is not names_lib.ALL_FFN}
  served = {entry.name for entry in names_lib.REGISTRY if entry.name in typed and names_lib.served(entry, model, 0)}
  assert served == set(spec.served_names)
  for name in spec.served_names:
    assert names_lib.resolve(f"layers[0].mlp.{name}", model).entry.name == name
  if spec.sparse:
    for name in (spec.circuit.units, spec.circuit.weights):
      resolved = names_lib.resolve(f"layers[0].mlp.{name}", model)
      assert resolved.tap_name == name  # the circuit is read from the tap of that name


def test_spec_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    SPECS["mlp"].name = "other"
