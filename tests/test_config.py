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


@pytest.mark.parametrize(
  "old, new",
  [
    (dict(implementation="pallas"), "triton,mosaic,tpu"),
    (dict(implementation="pallas", gpu_kernel="mosaic"), "mosaic,tpu"),
    (dict(implementation="auto", gpu_kernel="triton_row_order"), "triton_row_order,tpu"),
    (dict(implementation="xla", gpu_kernel="auto"), "xla"),
    (dict(implementation="auto", gpu_kernel="auto"), "auto"),
  ],
)
def test_the_retired_kernel_knobs_name_the_one_that_replaced_them(old, new):
  """A config written with the family value and kernel.gpu_kernel: one line naming the new value; the same config
  saved in a workdir reads under it."""
  from sparsetx.train.checkpoints import checkpointing

  config = _config(ffn=dict(type="sgatlin"))
  config.model.ffn.kernel.update(old)
  if new != "auto" and new != "xla":
    with pytest.raises(config_lib.ConfigError) as error:
      config_lib.validate(config)
    assert f"config.model.ffn.kernel.implementation={new!r}" in str(error.value) and "\n" not in str(error.value)
  saved = config_lib.default_config().to_dict()
  saved["model"]["ffn"]["kernel"].update(old)
  kernel = checkpointing.config_from_saved(saved).model.ffn.kernel
  assert kernel.implementation == new and "gpu_kernel" not in kernel
  config_lib.validate(checkpointing.config_from_saved(saved))


def test_an_implementation_the_registry_lacks_is_one_line_at_setup():
  from sparsetx.train import state as state_lib

  config = _config(ffn=dict(type="sgatlin"))
  config.model.ffn.kernel.implementation = "triton,cuda"
  with pytest.raises(
    config_lib.ConfigError,
    match="config.model.ffn.kernel.implementation: kernel implementation='cuda' is unknown; use auto, reference, one of mosaic, triton",
  ):
    state_lib.setup(config_lib.validate(config))
  config.model.ffn.kernel.implementation = "Triton!"
  with pytest.raises(config_lib.ConfigError, match=r"config.model.ffn.kernel.implementation='Triton!' must be auto"):
    config_lib.validate(config)
