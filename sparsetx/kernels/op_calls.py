"""One call of a kernel op, described so that the autotuner can make the same call again: the layer's sizes, dtypes
and gating as the compiled step has them. Its shape class (the autotune table's key) names everything that makes
two calls differ, the token count included: row reuse, which the row-order designs live on, grows with it.

Three forms: the gated gather (`gather`: sgatlin, PEER, FFF's deep levels), FFF's walk (`walk`), MoE's grouped
matmul (`grouped`). A call is a plain dict (JSON: it crosses into the autotuner's child processes).

More: docs/modules.md, sparsetx/kernels/op_calls.py.
"""

import math
import re

import jax.numpy as jnp

from sparsetx.kernels.rows.reference import ACTIVATIONS

_TOKENS = re.compile(r" N(\d+)\b")


def activation_name(activation) -> str:
  """The name ACTIVATIONS knows `activation` by; another callable is named but cannot be made again."""
  for name, known in ACTIVATIONS.items():
    if known is activation:
      return name
  return f"unnamed:{getattr(activation, '__name__', type(activation).__name__)}"


def gather(x_ND, w_in_RD, stream, slots: int, activation, gate_inside: bool, bias: bool, given_h: bool, split: bool):
  """The gated gather's call: x [N, D] and the tables [R, D] as this call sees them (a device's own tokens; with
  the d-split, their d-slices), read in `stream`."""
  return dict(
    form="gather",
    tokens=x_ND.shape[0],
    d_model=x_ND.shape[1],
    slots=slots,
    rows=w_in_RD.shape[0],
    dtype=jnp.dtype(x_ND.dtype).name,
    table_dtype=jnp.dtype(w_in_RD.dtype).name,
    stream=jnp.dtype(stream).name,
    activation=activation_name(activation),
    gate_inside=bool(gate_inside),
    bias=bool(bias),
    given_h=bool(given_h),
    d_split=bool(split),
  )


def walk(x_ND, w_in_PMD, levels: int, start: int):
  """FFF's walk down `levels` levels of P trees of M nodes, from the nodes of level `start`."""
  P, M, D = w_in_PMD.shape
  return dict(
    form="walk",
    tokens=x_ND.shape[0],
    d_model=D,
    trees=P,
    nodes=M,
    levels=levels,
    start=start,
    dtype=jnp.dtype(x_ND.dtype).name,
    table_dtype=jnp.dtype(w_in_PMD.dtype).name,
  )


def grouped(lhs_SK, rhs_EKN):
  """MoE's grouped matmul: S rows sorted by group, E groups of [K, N]."""
  E, K, N = rhs_EKN.shape
  dtypes = dict(dtype=jnp.dtype(lhs_SK.dtype).name, table_dtype=jnp.dtype(rhs_EKN.dtype).name)  # bf16 weights too
  return dict(form="grouped", rows=lhs_SK.shape[0], k=K, n=N, experts=E, **dtypes)


def shape_class(call: dict) -> str:
  """The table's key for a call: every field that makes calls differ, the tokens as `N<count>`."""
  if call["form"] == "grouped":
    weights = f" {call['table_dtype']} weights" if "table_dtype" in call else ""
    return f"{call['dtype']} N{call['rows']} K{call['k']} out{call['n']} E{call['experts']}{weights}"
  if call["form"] == "walk":
    return (
      f"walk {call['dtype']} N{call['tokens']} D{call['d_model']} P{call['trees']} M{call['nodes']} "
      f"L{call['start']}+{call['levels']} {call['table_dtype']} tables"
    )
  flags = [
    call["activation"],
    "gate-inside" if call["gate_inside"] else "gate-outside",
    *(["bias"] if call["bias"] else []),
    *(["given-h"] if call["given_h"] else []),
    *(["d-split"] if call["d_split"] else []),
  ]
  return (
    f"{call['stream']} N{call['tokens']} D{call['d_model']} S{call['slots']} R{call['rows']} "
    f"{call['dtype']} x {call['table_dtype']} tables {' '.join(flags)}"
  )


def tokens_of(shape_class_: str) -> int | None:
  """The token count a shape class names (None: it names none)."""
  found = _TOKENS.search(shape_class_)
  return int(found.group(1)) if found else None


def but_tokens(shape_class_: str) -> str:
  """The shape class with its token count blanked: calls that differ only in their tokens share it."""
  return _TOKENS.sub(" N*", shape_class_, count=1)


def token_distance(a: int, b: int) -> float:
  """How far apart two token counts are for choosing a kernel: their ratio on a log scale."""
  return abs(math.log(max(a, 1) / max(b, 1)))
