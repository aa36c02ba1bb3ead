"""The one registry of feed-forward layers: config.model.ffn.type -> flax module class."""

from sparsetx.models.ffn.dense import Mlp, SwiGlu
from sparsetx.models.ffn.fff import Fff
from sparsetx.models.ffn.moe import Moe
from sparsetx.models.ffn.peer import Peer
from sparsetx.models.ffn.sgatlin import Sgatlin

FFN_LAYERS = {
  "mlp": Mlp,
  "swiglu": SwiGlu,
  "moe": Moe,
  "peer": Peer,
  "sgatlin": Sgatlin,
  "fff": Fff,
}


def make_ffn(cfg, name: str = "mlp"):
  """The feed-forward layer the model config asks for, [B,T,D] -> [B,T,D]."""
  return FFN_LAYERS[cfg.ffn.type](cfg, name=name)
