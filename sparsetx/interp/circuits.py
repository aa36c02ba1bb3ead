"""Feed-forward circuits as sparse vectors, the sgatlin rebuild formula, and the circuit database.

More: docs/modules.md, sparsetx/interp/circuits.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from sparsetx import config as config_lib
from sparsetx.models.ffn.common import ACTIVATIONS, gelu_tanh
from sparsetx.models.ffn.registry import SPECS

SPARSE_TYPES = tuple(name for name, spec in SPECS.items() if spec.circuit is not None)


def circuit_of(cfg):
  """The FfnSpec.circuit of the model's sparse layers (config.model.ffn), refusing a type without one."""
  check_sparse(cfg)
  return SPECS[cfg.ffn.type].circuit


def check_sparse(cfg) -> None:
  if cfg.ffn.type not in SPARSE_TYPES:
    raise ValueError(
      f"config.model.ffn.type={cfg.ffn.type!r} has no sparse circuit; circuits exist for {', '.join(SPARSE_TYPES)}."
    )


def sparse_layers(cfg) -> tuple[int, ...]:
  """The layers with a sparse circuit: every layer, or those config.model.ffn_layers lists (mixed model)."""
  check_sparse(cfg)
  return config_lib.ffn_layer_indices(cfg)


def check_layer(cfg, layer: int, label: str = "layer") -> None:
  """Refuses a layer without a sparse circuit (a mixed model's dense layer, or none of the model's) by name."""
  layers = sparse_layers(cfg)
  if layer in layers:
    return
  listed = ", ".join(map(str, layers))
  if 0 <= layer < cfg.n_layers:
    raise config_lib.ConfigError(
      f"{label}={layer} is a dense layer ({config_lib.layer_ffn_config(cfg, layer).type!r}, config.model.dense_ffn) "
      f"of this mixed model and has no sparse circuit; use one of its {cfg.ffn.type} layers: {listed}."
    )
  raise config_lib.ConfigError(
    f"{label}={layer} is not a layer of this model; use one of its {cfg.ffn.type} layers: {listed}."
  )


def circuit_names(cfg, layer: int) -> tuple[str, str]:
  """The two standard names a layer's circuit is read from: (units, weights)."""
  check_layer(cfg, layer)
  circuit = circuit_of(cfg)
  return f"layers[{layer}].mlp.{circuit.units}", f"layers[{layer}].mlp.{circuit.weights}"


def n_units(cfg) -> int:
  """Size of the flat unit space a circuit indexes."""
  return circuit_of(cfg).size(cfg.ffn)


def sparse_circuit(cfg, units, weights):
  """(ids [..., S] int32, weights [..., S] float32) from a layer's traced unit ids and weights."""
  circuit = circuit_of(cfg)
  units = np.asarray(units)
  ids = circuit.ids(cfg.ffn, units)  # [..., G, K] -> [..., G * K], group g offset into its own block
  w = np.asarray(weights, np.float32) if circuit.weighted else np.ones(units.shape, np.float32)
  return ids.astype(np.int32), w.reshape(ids.shape)


def densify(cfg, ids_NS, weights_NS) -> np.ndarray:
  """[N, n_units] dense circuits (for a few queries, or an embedding of a few hundred points)."""
  dense = np.zeros((ids_NS.shape[0], n_units(cfg)), np.float32)
  np.put_along_axis(dense, ids_NS, weights_NS, axis=1)
  return dense


def cosine_distances(cfg, query_ids_QS, query_w_QS, ids_NS, w_NS, chunk: int = 4096) -> np.ndarray:
  """[Q, N] cosine distances between sparse circuits, without densifying the database."""
  query_QU = densify(cfg, query_ids_QS, query_w_QS)
  query_QU /= np.maximum(np.linalg.norm(query_QU, axis=1, keepdims=True), 1e-12)
  norms_N = np.maximum(np.linalg.norm(w_NS, axis=1), 1e-12)
  out = np.empty((query_QU.shape[0], ids_NS.shape[0]), np.float32)
  for start in range(0, ids_NS.shape[0], chunk):
    ids, w = ids_NS[start : start + chunk], w_NS[start : start + chunk]
    dots = (query_QU[:, ids] * w[None]).sum(-1)
    out[:, start : start + chunk] = np.maximum(1.0 - dots / norms_N[start : start + chunk], 0.0)
  return out


def rebuild_sgatlin_output(gate_vector_BTCN, experts_2CND, mlp_input_BTD, activation="identity"):
  """The sgatlin layer from its circuit: sum_c sum_n w_out[c,n] * act(g[c,n] * <w_in[c,n], z>).

  The whole layer is this formula with a fixed gate vector, which is why patching the gates is
  a do-intervention on the circuit alone (the tables and the input are left as they are). The gate sits
  inside the ablation activation as in the layer; act(0) = 0 for each of them, so unpicked neurons add
  nothing. `activation`: a name (GELU in the tanh form sgatlin's code uses) or the function itself.
  """
  act = activation if callable(activation) else (gelu_tanh if activation == "gelu" else ACTIVATIONS[activation])
  hi = jax.lax.Precision.HIGHEST
  h_BTCN = jnp.einsum("btd,cnd->btcn", mlp_input_BTD, experts_2CND[0], precision=hi)
  return jnp.einsum("btcn,cnd->btd", act(gate_vector_BTCN * h_BTCN), experts_2CND[1], precision=hi)


def _pad_rows(x, rows: int):
  return np.pad(x, [(0, rows - len(x))] + [(0, 0)] * (x.ndim - 1))


@dataclasses.dataclass
class CircuitDatabase:
  """Per recorded token n: input token, context (preceding tokens, -1 padded), top-5 predictions and,
  per sparse layer l, the sparse circuit ids[l, n], weights[l, n]; layers_L[l] is that layer's index
  in the model (every layer, or a mixed model's config.model.ffn_layers)."""

  tokens_N: np.ndarray
  context_NW: np.ndarray
  top5_N5: np.ndarray
  ids_LNS: np.ndarray
  weights_LNS: np.ndarray
  ffn_type: str
  layers_L: np.ndarray

  def __len__(self) -> int:
    return len(self.tokens_N)

  def row(self, layer: int) -> int:
    """The row of ids_LNS / weights_LNS that holds model layer `layer`."""
    rows = np.flatnonzero(self.layers_L == layer)
    if not len(rows):
      raise config_lib.ConfigError(
        f"layer {layer} has no circuits in this database; it holds layers {', '.join(map(str, self.layers_L))}."
      )
    return int(rows[0])

  def ids(self, layer: int) -> np.ndarray:
    return self.ids_LNS[self.row(layer)]

  def weights(self, layer: int) -> np.ndarray:
    return self.weights_LNS[self.row(layer)]

  def save(self, path: epath.PathLike) -> None:
    with epath.Path(path).open("wb") as f:  # local or a URL
      np.savez_compressed(f, **{k: np.asarray(v) for k, v in dataclasses.asdict(self).items()})

  @classmethod
  def load(cls, path: epath.PathLike) -> "CircuitDatabase":
    with epath.Path(path).open("rb") as f, np.load(f, allow_pickle=False) as data:
      fields = {field.name: data[field.name] for field in dataclasses.fields(cls) if field.name in data}
    fields.setdefault("layers_L", np.arange(len(fields["ids_LNS"])))  # saved before mixed models: every layer
    return cls(**{**fields, "ffn_type": str(fields["ffn_type"])})


def record(model, rows: dict, context: int = 8, batch_rows: int = 16) -> CircuitDatabase:
  """The circuit database of the real tokens of validation `rows` (see checkpoint.validation_rows), at
  every sparse layer."""
  cfg = model.cfg
  layers = sparse_layers(cfg)
  names_L = [circuit_names(cfg, layer) for layer in layers]
  reads = [name for pair in names_L for name in pair] + ["logits"]
  tokens, contexts, top5, ids, weights = [], [], [], [], []
  for start in range(0, len(rows["inputs"]), batch_rows):
    # every batch padded to batch_rows (padding has loss weight 0): one compiled program
    batch = {k: _pad_rows(v[start : start + batch_rows], batch_rows) for k, v in rows.items()}
    out = model.trace(batch["inputs"], reads, positions_BT=batch["positions"], segment_ids_BT=batch["segment_ids"])
    real_BT = batch["loss_weights"] > 0
    b_idx, t_idx = np.nonzero(real_BT)
    inputs_BT, segments_BT = batch["inputs"], batch["segment_ids"]
    window = np.arange(-context, 0)
    ctx_t = t_idx[:, None] + window
    valid = (ctx_t >= 0) & (segments_BT[b_idx[:, None], np.maximum(ctx_t, 0)] == segments_BT[b_idx, t_idx][:, None])
    contexts.append(np.where(valid, inputs_BT[b_idx[:, None], np.maximum(ctx_t, 0)], -1))
    tokens.append(inputs_BT[b_idx, t_idx])
    logits_NV = np.asarray(out["logits"])[b_idx, t_idx]
    top5.append(np.argsort(-logits_NV, axis=-1)[:, :5])
    layer_ids, layer_w = zip(
      *(
        sparse_circuit(cfg, np.asarray(out[units])[b_idx, t_idx], np.asarray(out[w])[b_idx, t_idx])
        for units, w in names_L
      )
    )
    ids.append(np.stack(layer_ids))
    weights.append(np.stack(layer_w))
  return CircuitDatabase(
    tokens_N=np.concatenate(tokens).astype(np.int32),
    context_NW=np.concatenate(contexts).astype(np.int32),
    top5_N5=np.concatenate(top5).astype(np.int32),
    ids_LNS=np.concatenate(ids, axis=1),
    weights_LNS=np.concatenate(weights, axis=1),
    ffn_type=cfg.ffn.type,
    layers_L=np.asarray(layers, np.int32),
  )
