"""The one registry of feed-forward types: config.model.ffn.type -> its FfnSpec (sparsetx/models/ffn/spec.py)."""

from sparsetx.models.ffn import dense, fff, moe, peer, sgatlin

SPECS = {spec.name: spec for spec in (dense.MLP_SPEC, dense.SWIGLU_SPEC, moe.SPEC, peer.SPEC, sgatlin.SPEC, fff.SPEC)}
FFN_LAYERS = {name: spec.module for name, spec in SPECS.items()}  # type -> flax module class


def make_ffn(cfg, name: str = "mlp"):
  """The feed-forward layer the model config asks for, [B,T,D] -> [B,T,D]."""
  return SPECS[cfg.ffn.type].module(cfg, name=name)
