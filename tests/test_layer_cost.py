"""The analytic per-layer cost (sparsetx/plan/layer_cost.py) against hand-computed bytes and FLOPs.

Every expected number is literal arithmetic from the formulas in the module's docstring (bf16 compute: 2 bytes;
float32: 4; int32 ids: 4), written out here, not taken from the module's helpers.
"""

import ml_collections
import pytest

from sparsetx import config as config_lib
from sparsetx import hardware
from sparsetx.models.ffn.registry import SPECS
from sparsetx.perf import cost, roofline
from sparsetx.plan import layer_cost

GATHER_KERNELS = (
  "gather fwd row_dots",
  "gather fwd row_accumulate",
  "gather bwd row_dots (dy.w_out)",
  "gather bwd row_accumulate (dx)",
)


def model_config(ffn_type, d_model=64, remat="none", dtype="bfloat16", **ffn):
  model = config_lib.model_defaults()
  model.update(d_model=d_model, dtype=dtype, remat=remat)
  model.ffn.type = ffn_type
  model.ffn.update(ffn)
  return ml_collections.FrozenConfigDict(model)


def sgatlin(d_model=64, top_k=2, remat="none", dtype="bfloat16"):
  return model_config("sgatlin", d_model, remat, dtype, n_channels=4, d_ffw=64, top_k=top_k, d_key=16)


def phases(cost):
  return {p.name: (p.nbytes, p.flops) for p in cost.phases}


def collectives(cost):
  return [(c.op, c.nbytes, c.group) for c in cost.collectives]


def test_sgatlin_phases_by_hand():
  """D=64, C=4 channels over E=2 devices, d_ffw=64 (8 keys a half), k=2, d_key=16, 128 own tokens, bf16.

  On the device: 2 channels, R = 2 x 64 = 128 rows, N = 256 group tokens, S = 2 x 2 = 4 rows each, 1,024 pairs.
  """
  model = sgatlin()
  got = phases(layer_cost.layer_cost(model, model.ffn, 128, expert_group=2, devices=2))
  expected = {
    # [128, 64] bf16 x [64, 16] f32 -> [128, 16] f32
    "router query": (128 * 64 * 2 + 64 * 16 * 4 + 128 * 16 * 4, 2 * 128 * 64 * 16),
    # dx = dq W^T (reads dq, W, writes dx) + dW = x^T dq (reads x, dq, writes dW f32)
    "router query backward": (
      (128 * 16 * 4 + 64 * 16 * 4 + 128 * 64 * 2) + (128 * 64 * 2 + 128 * 16 * 4 + 64 * 16 * 4),
      4 * 128 * 64 * 16,
    ),
    # [128, 16] x [16, 2 halves x 4 channels x 8 keys]
    "router key scores": (128 * 16 * 4 + 16 * 64 * 4 + 128 * 64 * 4, 2 * 128 * 16 * 64),
    "router key scores backward": (2 * (128 * 64 * 4 + 16 * 64 * 4 + 128 * 16 * 4), 4 * 128 * 16 * 64),
    # reads the 128 x 64 float32 scores, writes top-2 (value, id) of 2 halves x 4 channels
    "router top-k stage 1": (128 * 64 * 4 + 128 * 2 * 4 * 2 * 8, 128 * 64),
    # k=2: candidates (0,0), (0,1), (1,0); reads both halves' top-2, writes the top-2 (value, id) per channel
    "router top-k stage 2": (128 * 4 * 2 * 2 * 8 + 128 * 4 * 2 * 8, 128 * 4 * 3 * (1 + 2)),
    "router scores backward (scatter into halves)": (128 * 64 * 4 + 128 * 4 * 2 * 8, 0),
    # two tables of 128 x 64: read float32, write bf16
    "cast tables to compute dtype": (2 * 128 * 64 * (4 + 2), 0),
    # 1,024 rows of 64 bf16 + x [256, 64] bf16 + ids; writes h (float32)
    "gather fwd row_dots": (1024 * 64 * 2 + 256 * 64 * 2 + 1024 * 4 + 1024 * 4, 2 * 1024 * 64),
    # rows + ids + h and gates; writes y [256, 64] bf16
    "gather fwd row_accumulate": (1024 * 64 * 2 + 1024 * 4 + 2 * 1024 * 4 + 256 * 64 * 2, 2 * 1024 * 64),
    # w_out rows + dy + ids + h, gates; writes dgate, coef_in, coef_out
    "gather bwd row_dots (dy.w_out)": (
      1024 * 64 * 2 + 256 * 64 * 2 + 1024 * 4 + 2 * 1024 * 4 + 3 * 1024 * 4,
      2 * 1024 * 64,
    ),
    # w_in rows + ids + coef_in; writes dx
    "gather bwd row_accumulate (dx)": (1024 * 64 * 2 + 1024 * 4 + 1024 * 4 + 256 * 64 * 2, 2 * 1024 * 64),
    # 4 radix passes, each reading and writing 8 bytes per pair
    "table grads: sort (row, pair) keys": (4 * 1024 * 8 * 2, 0),
    # x and dy rows (bf16), token id + 2 coefficients per pair, two float32 tables 128 x 64 written
    "table grads: segment sums": (2 * 1024 * 64 * 2 + 3 * 1024 * 4 + 2 * 128 * 64 * 4, 2 * 2 * 1024 * 64),
    # rows cut at 64 pairs (kernel.segment_chunk): per table 1,024 // 64 = 16 tail segments of 64 float32 written,
    # 16 long-row slots + 16 tails read back (a row of 64 float32, a token id, a coefficient), 16 rows written and
    # set into the sums, and 1,024 pairs' token ids and coefficients read and written in head/tail order
    "table grads: cut rows combined": (
      2 * (16 * 64 * 4 + (16 + 16) * (64 * 4 + 4 + 4) + 2 * 16 * 64 * 4 + 1024 * 2 * (4 + 4)),
      0,
    ),
    # tables 2 x 128 x 64, the query 64 x 16, this device's keys 16 x 2 x 4 x 8 / 2; 7 float32 values each
    "optimizer (AdamW)": (
      (2 * 128 * 64 + 64 * 16 + 16 * 2 * 4 * 8 // 2) * 4 * 7,
      (2 * 128 * 64 + 64 * 16 + 16 * 2 * 4 * 8 // 2) * cost.ADAMW_FLOPS,
    ),
  }
  assert got == expected
  # the forward's matmuls and gathers are the ladder's FLOP accounting (FfnSpec.flops) for the 128 own tokens
  forward = ("router query", "router key scores", "gather fwd row_dots", "gather fwd row_accumulate")
  assert sum(got[name][1] for name in forward) == 128 * SPECS["sgatlin"].flops(model, model.ffn)


def test_sgatlin_collectives_by_hand():
  model = sgatlin()
  cost = layer_cost.layer_cost(model, model.ffn, 128, expert_group=2, devices=2)
  assert collectives(cost) == [
    ("all-reduce", 64 * 16 * 4, 2),  # the replicated query's gradient; tables and keys live on one device each
    ("all-gather", 128 * 2 * 64 * 2, 2),  # x of the group's 256 tokens, bf16
    ("all-to-all", 128 * 4 * 2 * 8, 2),  # int32 index + f32 gate per (token, channel, slot)
    ("reduce-scatter", 128 * 64 * 4, 2),  # y of the own tokens, float32
    ("all-gather", 128 * 2 * 64 * 2, 2),  # dy, bf16 (the cotangent of the bf16 output)
    ("reduce-scatter", 128 * 64 * 4, 2),  # dx, float32
    ("all-to-all", 128 * 4 * 2 * 4, 2),  # gate gradients
  ]
  # docs/expert_parallel.md: forward sends (E-1) D b + (E-1)/E C k 8 + (E-1) D 4 bytes per own token
  h100 = hardware.CHIPS["h100"]
  forward = cost.collectives[1:4]
  seconds = sum(roofline.collective_seconds(c.op, c.nbytes, c.group, h100) for c in forward)
  assert seconds == pytest.approx(128 * (1 * 64 * 2 + 1 / 2 * 4 * 2 * 8 + 1 * 64 * 4) / 450e9)


def test_fff_phases_by_hand():
  """D=32, 4 trees of depth 4 (5 levels, 31 nodes) over E=2: 2 trees, 62 rows, N = 128; 3 dense levels, 2 walked."""
  model = model_config("fff", 32, n_trees=4, depth=4)
  cost = layer_cost.layer_cost(model, model.ffn, 64, expert_group=2, devices=2)
  got = phases(cost)
  assert got["top levels: logits (dense)"] == (128 * 32 * 2 + 32 * 14 * 2 + 128 * 14 * 4, 2 * 128 * 32 * 14)
  assert got["top levels: outputs (dense)"] == (128 * 14 * 2 + 14 * 32 * 2 + 128 * 32 * 4, 2 * 128 * 14 * 32)
  # per deeper level: 256 rows of 32 bf16, x, node ids and b_in read, logits and next ids written
  assert got["walk: 2 x row_dots (S=2)"] == (
    2 * (256 * 32 * 2 + 128 * 32 * 2 + 2 * 256 * 4 + 2 * 256 * 4),
    2 * 2 * 256 * 32,
  )
  assert "gather fwd row_dots" not in got  # the walk's logits are the pre-activations
  # S = 2 trees x 2 walked levels = 4: 512 pairs
  assert got["gather fwd row_accumulate"] == (512 * 32 * 2 + 512 * 4 + 2 * 512 * 4 + 128 * 32 * 2, 2 * 512 * 32)
  assert got["table grads: sort (row, pair) keys"] == (4 * 512 * 8 * 2, 0)
  assert got["table grads: segment sums"] == (
    2 * 512 * 32 * 2 + 3 * 512 * 4 + 2 * 62 * 32 * 4 + 62 * 4,  # and the float32 b_in gradient
    2 * 2 * 512 * 32,
  )
  assert got["optimizer (AdamW)"][0] == (62 * 2 * 32 + 62 + 32) * 4 * 7
  assert collectives(cost) == [
    ("all-gather", 128 * 32 * 2, 2),
    ("reduce-scatter", 64 * 32 * 4, 2),
    ("all-to-all", 64 * 4 * 5 * 8, 2),  # path node and logit per (token, tree, level)
    ("all-gather", 128 * 32 * 4, 2),
    ("reduce-scatter", 64 * 32 * 4, 2),
  ]
  # the dense top levels evaluate 7 nodes per tree where the path visits 3: 2 x 2 x 4 extra nodes x D per token
  forward = ("top levels: logits (dense)", "top levels: outputs (dense)", "walk: 2 x row_dots (S=2)")
  forward_flops = sum(got[name][1] for name in forward) + got["gather fwd row_accumulate"][1]
  assert forward_flops == 64 * SPECS["fff"].flops(model, model.ffn) + 64 * 2 * 2 * 4 * 4 * 32


def test_moe_phases_by_hand():
  """D=32, 4 SwiGLU experts of d_ffw 16, top-2, E=2: 2 experts, 128 group tokens, 256 pairs sorted, 128 computed."""
  model = model_config("moe", 32, n_experts=4, d_ffw=16, experts_per_token=2)
  cost = layer_cost.layer_cost(model, model.ffn, 64, expert_group=2, devices=2)
  got = phases(cost)
  assert got["router"] == (64 * 32 * 2 + 32 * 4 * 4 + 64 * 4 * 4, 2 * 64 * 32 * 4)
  assert got["dispatch: sort the group's pairs"] == (4 * 256 * 8 * 2, 0)
  assert got["dispatch: gather x rows of every pair"] == (2 * 256 * 32 * 2, 0)
  assert got["experts: gate and up (grouped)"] == (128 * 32 * 2 + 32 * 32 * 2 + 128 * 32 * 4, 2 * 128 * 32 * 32)
  assert got["experts: down (grouped)"] == (128 * 16 * 2 + 16 * 32 * 2 + 128 * 32 * 4, 2 * 128 * 16 * 32)
  assert got["cast tables to compute dtype"] == (3 * 2 * 32 * 16 * 6, 0)
  forward_dots = got["router"][1] + got["experts: gate and up (grouped)"][1] + got["experts: down (grouped)"][1]
  assert forward_dots == 64 * SPECS["moe"].flops(model, model.ffn)
  assert collectives(cost) == [
    ("all-reduce", (32 * 4 + 4) * 4, 2),  # the replicated router's gradient
    ("all-gather", 2 * 4 * 4, 2),  # the per-expert pair counts of both devices
    ("all-to-all", 128 * 32 * 2, 2),  # the 64 x 2 pairs' x rows (bf16) to their experts, by ragged all-to-all
    ("all-to-all", 128 * 32 * 2, 2),  # their outputs back, each pair's alone in bf16 (summed at the owner)
    ("all-to-all", 128 * 32 * 2, 2),  # dy rows
    ("all-to-all", 128 * 32 * 2, 2),  # dx rows
  ]


@pytest.mark.parametrize("ffn_type, ins", [("mlp", 1), ("swiglu", 2)])
def test_dense_phases_by_hand(ffn_type, ins):
  model = model_config(ffn_type, 32, d_ffw=64)
  got = phases(layer_cost.layer_cost(model, model.ffn, 64))
  assert got["in projection" + ("s (gate, up)" if ins == 2 else "")] == (
    64 * 32 * 2 + 32 * ins * 64 * 2 + 64 * ins * 64 * 2,
    2 * 64 * 32 * ins * 64,
  )
  assert got["out projection"] == (64 * 64 * 2 + 64 * 32 * 2 + 64 * 32 * 2, 2 * 64 * 64 * 32)
  assert got["optimizer (AdamW)"] == ((ins + 1) * 32 * 64 * 28, (ins + 1) * 32 * 64 * cost.ADAMW_FLOPS)
  assert got["in projection" + ("s (gate, up)" if ins == 2 else "")][1] + got["out projection"][1] == 64 * SPECS[
    ffn_type
  ].flops(model, model.ffn)


def gather_totals(cost):
  got = phases(cost)
  return sum(got[name][0] for name in GATHER_KERNELS), sum(got[name][1] for name in GATHER_KERNELS)


def test_gathers_scale_linearly_in_tokens_d_model_and_k():
  def cost(tokens=128, d_model=64, top_k=2):
    model = sgatlin(d_model, top_k)
    return layer_cost.layer_cost(model, model.ffn, tokens, expert_group=2, devices=2)

  nbytes, flops = gather_totals(cost())
  # tokens: every term of the kernels is per token or per pair
  assert gather_totals(cost(tokens=384)) == (3 * nbytes, 3 * flops)
  # d_model: FLOPs proportional; bytes grow by (4 x 1,024 pairs + 4 x 256 tokens) x 2 bytes per added value
  nbytes_2d, flops_2d = gather_totals(cost(d_model=128))
  assert flops_2d == 2 * flops and nbytes_2d - nbytes == 64 * (4 * 1024 + 4 * 256) * 2
  # k (S): FLOPs proportional; bytes grow per added pair by 4 rows x 64 x 2 bytes, 4 ids and 9 float32 scalars
  # (h written; h, gate read; h, gate read and dgate, coef_in, coef_out written; coef_in read)
  nbytes_4k, flops_4k = gather_totals(cost(top_k=4))
  assert flops_4k == 2 * flops and nbytes_4k - nbytes == 1024 * (4 * 64 * 2 + 4 * 4 + (1 + 2 + 5 + 1) * 4)


def test_optimizer_and_cast_do_not_depend_on_tokens():
  model = sgatlin()
  small, large = (phases(layer_cost.layer_cost(model, model.ffn, n, expert_group=2)) for n in (128, 4096))
  for name in ("optimizer (AdamW)", "cast tables to compute dtype"):
    assert small[name] == large[name]
  assert large["table grads: segment sums"][1] == 32 * small["table grads: segment sums"][1]


def test_float32_runs_cast_nothing():
  model = sgatlin(dtype="float32")
  got = phases(layer_cost.layer_cost(model, model.ffn, 128, expert_group=2))
  assert "cast tables to compute dtype" not in got
  assert got["gather fwd row_dots"][0] == 1024 * 64 * 4 + 256 * 64 * 4 + 1024 * 4 + 1024 * 4


@pytest.mark.parametrize("ffn_type", ["sgatlin", "fff", "moe", "mlp"])
def test_full_remat_doubles_the_forward_and_nothing_else(ffn_type):
  fields = dict(
    sgatlin=dict(n_channels=4, d_ffw=64, top_k=2, d_key=16),
    fff=dict(n_trees=4, depth=4),
    moe=dict(n_experts=4, d_ffw=16, experts_per_token=2),
    mlp=dict(d_ffw=64),
  )[ffn_type]
  E = 1 if ffn_type == "mlp" else 2
  none, full = (
    layer_cost.layer_cost(model_config(ffn_type, 32, remat, **fields), model_config(ffn_type, 32, **fields).ffn, 64, E)
    for remat in ("none", "full")
  )
  assert [p.name for p in none.phases] == [p.name for p in full.phases]
  forward = 0
  for a, b in zip(none.phases, full.phases):
    assert a.runs == 1 and (b.nbytes, b.flops) == (b.runs * a.nbytes, b.runs * a.flops)
    forward += b.runs == 2
    if "backward" in a.name or "bwd" in a.name or "grads" in a.name or "optimizer" in a.name or "cast" in a.name:
      assert b.runs == 1, a.name
  assert forward >= 2
  for a, b in zip(none.collectives, full.collectives):
    assert b.nbytes == b.runs * a.nbytes
  forward_flops = sum(a.flops for a, b in zip(none.phases, full.phases) if b.runs == 2)
  assert full.flops - none.flops == forward_flops  # one more forward
  if E > 1:  # the forward's move of x runs again in the recomputed forward, the backward's dy once
    runs = {c.what: c.runs for c in full.collectives if c.op in ("all-gather", "all-to-all")}
    dy = dict(moe="dy rows to the experts (ragged)", sgatlin="dy to the expert group")
    dy = dy.get(ffn_type, "dy to the expert group (float32)")
    assert runs[next(w for w in runs if w.startswith("x"))] == 2 and runs[dy] == 1


def test_dots_policies_recompute_only_the_non_matmul_forward():
  model = sgatlin(remat="dots_saveable")
  runs = {p.name: p.runs for p in layer_cost.layer_cost(model, model.ffn, 128, expert_group=2).phases}
  assert runs["router query"] == 1 and runs["router key scores"] == 1  # matmul outputs are saved
  assert runs["gather fwd row_dots"] == 2 and runs["router top-k stage 1"] == 2  # kernels and top-k are not


def test_layer_time_is_the_sum_of_phase_maxima_and_collectives():
  model = sgatlin()
  layer = layer_cost.layer_cost(model, model.ffn, 4096, expert_group=2, devices=2)
  chip = hardware.CHIPS["v5p"]
  t = cost.time_on(layer, chip)
  by_hand = [max(p.nbytes / 2765e9, p.flops / 459e12) for p in layer.phases]
  hbm = [p.nbytes / 2765e9 for p in layer.phases if p.nbytes / 2765e9 > p.flops / 459e12]
  comm = sum(roofline.collective_seconds(c.op, c.nbytes, c.group, chip) for c in layer.collectives)
  assert t.total_s == pytest.approx(sum(by_hand) + comm)
  assert t.hbm_share == pytest.approx(sum(hbm) / (sum(by_hand) + comm))
  assert 0 < t.hbm_share < 1


def test_groups_follow_the_mesh_rules():
  config = config_lib.default_config()
  config.model.ffn.type = "sgatlin"
  config.data.update(global_batch_size=16, seq_len=64)
  mesh = dict(data=2, fsdp=2, tensor=1, expert=4)
  assert layer_cost.groups(config, config.model.ffn, mesh) == (4, 2)  # channels on expert, d_model on fsdp
  assert layer_cost.tokens_per_device(config, mesh) == 16 * 64 // 16
  config.model.ffn.type = "mlp"
  assert layer_cost.groups(config, config.model.ffn, mesh) == (1, 2)


def test_d_split_keeps_the_gather_bytes_per_device():
  """G devices each gather G x the tokens' rows of D / G values: the same row bytes and FLOPs per device, G x the
  pairs' ids and float32 scalars (4 ids and 9 scalars of 4 bytes per pair over the four kernels)."""
  model = sgatlin()
  whole = gather_totals(layer_cost.layer_cost(model, model.ffn, 128, expert_group=2))
  split = layer_cost.layer_cost(model, model.ffn, 128, expert_group=2, d_group=2)
  assert gather_totals(split) == (whole[0] + (2 - 1) * 1024 * (4 + 9) * 4, whole[1])
  assert ("all-reduce", 2 * 128 * 4 * 2 * 4, 2) in collectives(split)  # partial dots, float32


def test_dry_run_table_prints_each_phase_and_chip(capsys):
  from sparsetx.parallel import mesh as mesh_lib
  from sparsetx.tools import dry_run

  config = config_lib.default_config()
  config.model.update(d_model=64, n_layers=2, head_dim=32)
  config.model.ffn.update(type="sgatlin", n_channels=4, d_ffw=64, top_k=2, d_key=16)
  config.data.update(global_batch_size=8, seq_len=32)
  config.mesh.ici.update(data=2, expert=4)
  mesh = mesh_lib.make_mesh(config.mesh)
  dry_run.print_analytic(config, mesh, hardware.chips("all"))
  text = capsys.readouterr().out
  assert "sgatlin feed-forward (layers 0..1; per layer and device, 32 tokens" in text
  for name in GATHER_KERNELS + ("router top-k stage 1", "table grads: segment sums", "optimizer (AdamW)"):
    assert f"  {name} " in text
  assert "H100 us   H200 us    v5p us    v6e us" in text
  share = [line.split()[-4:] for line in text.splitlines() if line.startswith("  HBM-bound share")]
  assert len(share) == 1 and all(cell.endswith("%") for cell in share[0])
  rows = [line.split() for line in text.splitlines() if line.startswith(("  H100", "  H200", "  TPU"))]
  assert [" ".join(r[:2]) for r in rows] == ["H100 SXM", "H200 SXM", "TPU v5p", "TPU v6e"]


def test_ladder_table_has_every_type_scale_and_chip():
  rows = layer_cost.ladder_rows(scales=(2,), ffn_types=("sgatlin", "fff", "moe", "mlp"))
  assert [(t, s, E) for t, s, E, _, _ in rows] == [("sgatlin", 2, 8), ("fff", 2, 4), ("moe", 2, 8), ("mlp", 2, 1)]
  text = layer_cost.format_ladder(rows)
  assert text.count("\n") == 1 + len(rows) and "| sgatlin | 2 | 8 |" in text


def test_remainder_forward_matmuls_are_the_ladder_accounting():
  """The rest of the step: attention projections and kernel per block and the head, as models/ladder.py counts
  their forward FLOPs (2 (4 D^2 + 2 T D) per token and block, 2 D V for the head), for the own tokens."""
  from sparsetx.models import ladder

  config = config_lib.default_config()
  config.model.update(d_model=64, n_layers=3, head_dim=32, vocab_size=512, remat="none")
  config.data.update(global_batch_size=8, seq_len=32)
  mesh = dict(data=8, fsdp=1, tensor=1, expert=1)
  got = phases(layer_cost.remainder_cost(config, mesh))
  forward = ("3 x attention q, k, v", "3 x attention out", "3 x attention kernel", "head")
  counts = ladder.forward_flops_per_token(config.model, 32)
  assert sum(got[name][1] for name in forward) == 32 * (counts["attention"] + counts["head"])
  # the head: [32, 64] float32 x [64, 512] float32 -> float32 logits (config.model.logits_dot_in_fp32, the default),
  # and again in the backward: the chunked loss (config.train.loss_chunks 8) recomputes each tile's logits
  assert got["head"][0] == got["head recomputed by the chunked loss"][0] == 32 * 64 * 4 + 64 * 512 * 4 + 32 * 512 * 4
  assert got["head recomputed by the chunked loss"][1] == got["head"][1]
  config.model.logits_dot_in_fp32, config.train.loss_chunks = False, 0  # bf16 operands, the whole logits at once
  got = phases(layer_cost.remainder_cost(config, mesh))
  assert (
    got["head"][0] == 32 * 64 * 2 + 64 * 512 * 2 + 32 * 512 * 4 and "head recomputed by the chunked loss" not in got
  )


def test_dry_run_tool_prints_the_layer_table():
  """python -m sparsetx.tools.dry_run on simulated CPU devices: the analytic table of the accelerators' kernels."""
  import subprocess
  import sys

  from conftest import MICRO_SGATLIN_FLAGS, REPO

  micro = [*MICRO_SGATLIN_FLAGS, "--config.mesh.ici.data=2", "--config.mesh.ici.expert=4"]
  result = subprocess.run(
    [sys.executable, "-m", "sparsetx.tools.dry_run", "--config=configs/tiny.py:sgatlin", "--devices=8", *micro],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  text = result.stdout
  assert "sgatlin feed-forward (layers 0..1; per layer and device, 16 tokens" in text
  assert "  all-gather /4: x to the expert group " in text and "  gather bwd row_accumulate (dx) " in text
  rows = [line.split() for line in text.splitlines() if line.startswith(("  H100", "  H200", "  TPU"))]
  # the compiled program's roofline, then the analytic projection: a row per chip in each
  assert [" ".join(r[:2]) for r in rows] == ["H100 SXM", "H200 SXM", "TPU v5p", "TPU v6e"] * 2


def test_moe_shared_experts_and_sigmoid_scores_by_hand():
  """2 shared experts of d_ffw 16 (one SwiGLU of 32) on the device's 64 tokens, and sigmoid scores: the phases the
  options add; the forward dots still the spec's FLOPs (the sigmoid's 4 a score beside them)."""
  model = model_config(
    "moe", 32, n_experts=4, d_ffw=16, experts_per_token=2, n_shared_experts=2, router_scores="sigmoid"
  )
  got = phases(layer_cost.layer_cost(model, model.ffn, 64, expert_group=2, devices=2))
  assert got["shared experts: gate and up"] == (64 * 32 * 2 + 32 * 64 * 2 + 64 * 64 * 2, 2 * 64 * 32 * 64)
  assert got["shared experts: down"] == (64 * 32 * 2 + 32 * 32 * 2 + 64 * 32 * 2, 2 * 64 * 32 * 32)
  assert got["router sigmoid"] == (2 * 64 * 4 * 4, 4 * 64 * 4)
  forward_dots = sum(
    got[name][1]
    for name in ("router", "experts: gate and up (grouped)", "experts: down (grouped)", "shared experts: gate and up")
  )
  forward_dots += got["shared experts: down"][1] + got["router sigmoid"][1]
  assert forward_dots == 64 * SPECS["moe"].flops(model, model.ffn)
