import pytest

from sparsetx import config as config_lib


def _config(**model):
  config = config_lib.default_config()
  ffn = model.pop("ffn", {})
  config.model.update(model)
  config.model.ffn.update(ffn)
  return config


def test_defaults_validate():
  config_lib.validate(config_lib.default_config())


@pytest.mark.parametrize(
  "model, field",
  [
    (dict(ffn=dict(type="dense_moe")), "config.model.ffn.type"),
    (dict(d_model=100, head_dim=64), "config.model.d_model"),
    (dict(ffn=dict(type="sgatlin", d_ffw=1000)), "config.model.ffn.d_ffw"),
    (dict(ffn=dict(type="peer", d_ffw=1000)), "config.model.ffn.d_ffw"),
    (dict(ffn=dict(type="sgatlin", d_ffw=64, top_k=8)), "config.model.ffn.top_k"),
    (dict(ffn=dict(type="peer", d_ffw=64, top_k=9)), "config.model.ffn.top_k"),
    (dict(ffn=dict(type="fff", depth=-1)), "config.model.ffn.depth"),
    (dict(ffn=dict(type="fff", n_trees=0)), "config.model.ffn.n_trees"),
    (dict(ffn=dict(type="sgatlin", activation="tanh")), "config.model.ffn.activation"),
    (dict(ffn=dict(type="moe", n_experts=2, experts_per_token=3)), "config.model.ffn.experts_per_token"),
    (dict(block="serial"), "config.model.block"),
    (dict(rotary_fraction=1.5), "config.model.rotary_fraction"),
  ],
)
def test_bad_config_names_the_field(model, field):
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.validate(_config(**model))
  message = str(error.value)
  assert message.startswith(field + "="), message
  assert message.count(".") >= 2 and "\n" not in message
