"""The save cadence (sparsetx/plan/save_cadence.py): Daly's goodput, its optimum against Young's and Daly's closed
forms, the measured costs of a goodput record, and the plan's estimated checkpoint bytes."""

import json
import math

import pytest
from conftest import load_config

from sparsetx import config as config_lib
from sparsetx.plan import save_cadence


@pytest.mark.parametrize(
  "tau, save, restart, mtbf, expected",
  [
    # M = 10,000 s, delta = 100 s, R = 500 s, tau = 1,000 s:
    # e^(R/M) = e^0.05 = 1 + 0.05 + 0.00125 + 0.0000208 + 0.0000003 = 1.0512711
    # e^((tau + delta)/M) - 1 = e^0.11 - 1 = 0.11 + 0.00605 + 0.0002218 + 0.0000061 + 0.0000001 = 0.1162781
    # wall time per unit of work: 10,000 x 1.0512711 x 0.1162781 = 1,222.398 s per 1,000 s: goodput 0.818064
    (1000.0, 100.0, 500.0, 10_000.0, 0.818064),
    # No save and no restart cost, tau = M: goodput = M / (M (e - 1)) = 1 / 1.7182818 = 0.581977
    (3600.0, 0.0, 0.0, 3600.0, 0.581977),
    # M = 3,600 s, delta = 60 s, R = 600 s, tau = 540 s: both exponents are 1/6;
    # e^(1/6) = 1 + 0.1666667 + 0.0138889 + 0.0007716 + 0.0000322 + 0.0000011 = 1.1813605
    # 3,600 x 1.1813605 x 0.1813605 = 771.307 s per 540 s: goodput 0.700110
    (540.0, 60.0, 600.0, 3600.0, 0.700110),
  ],
)
def test_goodput_matches_values_computed_by_hand(tau, save, restart, mtbf, expected):
  assert float(save_cadence.goodput(tau, save, restart, mtbf)) == pytest.approx(expected, abs=2e-6)


def test_llama3_default_and_system_mtbf():
  """Llama 3 (section 3.3.4): 419 interruptions in 54 days on 16,384 GPUs; the system fails `chips` times as often."""
  assert save_cadence.LLAMA3_CHIP_MTBF_HOURS == pytest.approx(50_677.0, abs=1.0)
  assert save_cadence.system_mtbf_seconds(1024, 50_677.0) == pytest.approx(50_677.0 * 3600 / 1024)


@pytest.mark.parametrize("ratio", [1e-6, 1e-4, 1e-2, 0.1, 0.5])
def test_numeric_optimum_agrees_with_daly_and_young_to_the_expansions_order(ratio):
  """With x = sqrt(delta / 2M), Daly's expansion is tau = sqrt(2 delta M) (1 + x/3 + x^2/9) - delta, i.e. Young's
  times 1 - 2x/3 + x^2/9 (delta / sqrt(2 delta M) = x): the numeric optimum is Young's within (2/3) x + x^2, and
  Daly's within Young's times x^3 (the expansion's next order), both up to the search's 1e-6."""
  mtbf, restart = 1e5, 300.0
  save = ratio * mtbf
  x = math.sqrt(save / (2 * mtbf))
  young = math.sqrt(2 * save * mtbf)
  daly = young * (1 + x / 3 + x * x / 9) - save
  numeric = save_cadence.optimal_interval(save, restart, mtbf)
  assert save_cadence.young_interval(save, mtbf) == pytest.approx(young, rel=1e-12)
  assert save_cadence.daly_interval(save, mtbf) == pytest.approx(daly, rel=1e-12)
  assert abs(numeric / young - 1) <= 2 * x / 3 + x * x + 1e-6
  assert abs(numeric - daly) <= young * (x**3 + 1e-6)
  if ratio <= 1e-4:  # delta << M: the optimum approaches Young's
    assert numeric / young == pytest.approx(1 - 2 * x / 3, abs=x * x + 1e-6)


@pytest.mark.parametrize(
  "save, restart, mtbf", [(10.0, 600.0, 6 * 3600.0), (0.2, 400.0, 50 * 3600.0), (500.0, 0, 3600)]
)
def test_the_optimum_is_a_maximum_and_a_stationary_point(save, restart, mtbf):
  """d/dtau log goodput = 1/tau - (1/M) e^y / (e^y - 1), y = (tau + delta)/M, vanishes where
  tau = M (1 - e^(-(tau + delta)/M)); neighbours 1% either side have lower goodput."""
  tau = save_cadence.optimal_interval(save, restart, mtbf)
  assert tau == pytest.approx(mtbf * (1 - math.exp(-(tau + save) / mtbf)), rel=1e-6)
  best = float(save_cadence.goodput(tau, save, restart, mtbf))
  for eps in (0.01, -0.01, 0.001, -0.001):
    assert best > float(save_cadence.goodput(tau * (1 + eps), save, restart, mtbf))


def test_goodput_tends_to_one_as_failures_vanish():
  """M -> infinity: at a fixed tau goodput -> tau / (tau + delta) (only the saves cost), and at the optimum
  1 - goodput ~ sqrt(2 delta / M) + R / M -> 0."""
  save, restart = 5.0, 600.0
  previous = 0.0
  for mtbf in (1e4, 1e6, 1e8, 1e10):
    best = float(save_cadence.goodput(save_cadence.optimal_interval(save, restart, mtbf), save, restart, mtbf))
    assert previous < best < 1 and 1 - best <= 1.1 * (math.sqrt(2 * save / mtbf) + restart / mtbf)
    previous = best
  assert 1 - previous < 1e-4
  assert float(save_cadence.goodput(600.0, save, restart, 1e12)) == pytest.approx(600 / 605, rel=1e-6)


def write_record(tmp_path, record) -> object:
  from etils import epath

  path = epath.Path(tmp_path) / "goodput.json"
  path.write_text(record if isinstance(record, str) else json.dumps(record))
  return path


def test_measured_costs_are_the_means_of_the_record(tmp_path):
  path = write_record(
    tmp_path,
    dict(
      seconds={},
      costs=dict(save_seconds=[1.0, 3.0], restore_seconds=[], restart_seconds=[40.0, 50.0, 60.0], step_seconds=0.5),
    ),
  )
  costs = save_cadence.read_costs(path)
  assert (costs.save_s, costs.restart_s, costs.step_s) == (2.0, 50.0, 0.5)
  assert costs.save_source.startswith("measured") and str(path) in costs.save_source


@pytest.mark.parametrize(
  "record, words",
  [
    ({"seconds": {}, "wall": 1.0}, "holds no measured costs"),
    ({"costs": {"save_seconds": [], "restart_seconds": [9.0]}}, "measured no save"),
    ({"costs": {"save_seconds": [1.0]}}, "measured no restart"),
    ({"costs": {"save_seconds": "1", "restart_seconds": [9.0]}}, "costs.save_seconds must be a list"),
    ("{not json", "is not JSON"),
  ],
)
def test_a_record_without_measurements_is_one_sentence_naming_the_file(tmp_path, record, words):
  path = write_record(tmp_path, record)
  with pytest.raises(config_lib.ConfigError, match=words) as error:
    save_cadence.read_costs(path)
  assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_estimated_checkpoint_bytes_match_the_abstract_state():
  """The plan's bytes per device (parameters and AdamW moments) within 1% of the abstract train state's shards,
  which also hold the step, the bad-step window and the usage counts: configs/large.py:sgatlin8,h100 on 64 H100s."""
  import jax

  from sparsetx.measure import aot

  config = config_lib.validate(load_config("configs/large.py", "sgatlin8,h100"))
  mesh = jax.sharding.AbstractMesh((8, 1, 1, 8), config_lib.MESH_AXES)
  abstract, _, _, _ = aot.abstract_state(config, mesh)
  shards = sum(
    math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract)
  )
  estimate = save_cadence.state_bytes_per_device(config, dict(data=8, fsdp=1, tensor=1, expert=8))
  assert estimate == pytest.approx(shards, rel=0.01)


def test_machines_of_a_chip_count():
  assert save_cadence.machine("h100", 1024).name == "h100x8x128"
  assert save_cadence.machine("v5p", 8192).name == "v5p-8192x2"  # 6,144 chips at most per slice: two of 4,096
  with pytest.raises(config_lib.ConfigError, match="not whole nodes of 8"):
    save_cadence.machine("h100", 1020)


def test_extreme_costs_give_a_number_not_an_overflow():
  # A save of 800 MTBFs: every interval loses nearly all, and goodput falls as e^-(tau/M) once tau > M, while
  # tau / (e^(tau/M) - 1) rises toward M: the optimum is M itself (d/dtau of log tau - tau/M is 0 at tau = M).
  assert save_cadence.optimal_interval(80000.0, 10.0, 100.0) == pytest.approx(100.0, rel=1e-3)
  # A restart of a thousand MTBFs (an MTBF typed for the system, not the chip): a goodput of e^-1000, not a traceback.
  assert float(save_cadence.goodput(600.0, 60.0, 3.6e6, 3600.0)) == 0.0
  tau = save_cadence.optimal_interval(60.0, 3.6e6, 3600.0)  # R/M only scales goodput: the optimum is R's absent one
  assert tau == pytest.approx(save_cadence.optimal_interval(60.0, 0.0, 3600.0), rel=1e-5)  # a flat optimum
