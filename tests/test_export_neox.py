"""Export to the Hugging Face GPT-NeoX layout and import back (sparsetx/hf/export.py, neox.py).

A random tiny dense GPT-NeoX-block model (every bias and norm scale perturbed away from its init, so
each tensor's mapping is exercised) is exported; plain `transformers` loads it and its logits match the
JAX model's; importing gives back the same bits; the trainer resumes from the imported step-0 checkpoint.
"""

import errno
import json
import os
import unittest.mock

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import seqio
import test_workdir_fs
from conftest import init_params, load_config
from etils import epath
from export_checks import assert_same_export

from sparsetx import config as config_lib
from sparsetx.data import vocab as vocab_lib
from sparsetx.hf import export, neox, tokenizer_files
from sparsetx.models.transformer import Transformer
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.tools import build_vocab
from sparsetx.train import state as state_lib
from sparsetx.train.checkpoints import checkpointing

fake_gcs = test_workdir_fs.fake_gcs  # the fixture
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def neox_config(**model) -> ml_collections.ConfigDict:
  """configs/pythia.py shrunk: 4 heads of 16, rotary on a quarter of each head, padded vocabulary."""
  config = load_config("configs/pythia.py")
  config.model.update(dict(vocab_size=272, d_model=64, n_layers=2, head_dim=16, max_len=32, dtype="float32"), **model)
  config.model.ffn.update(d_ffw=128)
  config.data.update(seq_len=32, global_batch_size=8, eval_batch_size=8, shuffle_buffer=64)
  config.train.update(steps=1, warmup_steps=5, log_every=1, eval_every=1000, eval_batches=1)
  return config_lib.validate(config)


def random_params(config, seed=0) -> dict:
  """Init, then every leaf moved by noise: LayerNorm scales leave 1, biases leave 0."""
  model = Transformer(ml_collections.FrozenConfigDict(config.model))
  params = init_params(model, jnp.zeros((1, 8), jnp.int32), seed=seed)
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(tree, [np.asarray(x) + rng.normal(0, 0.1, x.shape).astype(np.float32) for x in leaves])


def jax_logits(config, params, tokens_BT) -> np.ndarray:
  model = Transformer(ml_collections.FrozenConfigDict(config.model))
  return np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(tokens_BT)))


def assert_same_params(expected, actual):
  flat_expected, flat_actual = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (expected, actual))
  assert flat_expected.keys() == flat_actual.keys()
  for path, value in flat_expected.items():
    assert np.asarray(flat_actual[path]).dtype == np.float32
    np.testing.assert_array_equal(np.asarray(flat_actual[path]), np.asarray(value), err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  config = neox_config()
  params = random_params(config)
  out = tmp_path_factory.mktemp("export") / "hf"
  assert export.write_hf(config, params, str(out)) == "hf_neox"
  return config, params, out


@pytest.mark.parametrize("variant", ["parallel_untied", "sequential_tied"])
def test_transformers_logits_match_jax(exported, tmp_path, variant):
  if variant == "parallel_untied":
    config, params, out = exported
  else:  # the use_parallel_residual=False block and a tied head (only embed_in is written)
    config = neox_config(block="sequential", tie_embeddings=True)
    params, out = random_params(config, seed=1), tmp_path / "hf"
    export.write_hf(config, params, str(out))
  cap = os.path.getsize(out / "model.safetensors") // 4  # transformers loads the sharded export
  export.write_hf(config, params, str(tmp_path / "sharded"), max_shard_size=cap)
  assert_same_export(out, tmp_path / "sharded", shards=4)
  out = tmp_path / "sharded"
  hf_config = json.loads((out / "config.json").read_text())
  assert hf_config["architectures"] == ["GPTNeoXForCausalLM"] and "auto_map" not in hf_config
  assert hf_config["tie_word_embeddings"] == config.model.tie_embeddings and hf_config["vocab_size"] == 272
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  assert type(model).__name__ == "GPTNeoXForCausalLM"
  tokens_BT = np.random.default_rng(2).integers(0, 272, (3, 32))
  tokens_BT[:, 0] = 0  # the start id every training document begins with
  with torch.no_grad():
    hf_logits = model(torch.from_numpy(tokens_BT)).logits.numpy()
  np.testing.assert_allclose(hf_logits, jax_logits(config, params, tokens_BT), atol=1e-4, rtol=0)
  # The mapping, not the check, carries the result: a wrong head permutation or rotary pairing would be O(1).
  assert np.abs(hf_logits).max() > 0.5
  # What transformers itself writes (save_pretrained names the head lm_head) imports to the same bits.
  model.save_pretrained(str(tmp_path / "resaved"))
  resaved_config, resaved = export.load_hf(str(tmp_path / "resaved"))
  assert_same_params(params, resaved)
  assert resaved_config.model.tie_embeddings == config.model.tie_embeddings


def test_import_gives_back_identical_params_and_config(exported):
  config, params, out = exported
  imported, imported_params = export.load_hf(str(out))
  assert_same_params(params, imported_params)
  assert imported.model.to_dict() == config.model.to_dict()
  assert imported.data.vocab.kind == "byte"


def test_tokenizer_encodes_like_seqio_byte_vocabulary(exported):
  _, _, out = exported
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
  vocabulary = seqio.ByteVocabulary()
  text = "Pythia wörds, 日本 🙂\n\t<pad></s> end"
  ids = list(vocabulary.encode(text))
  assert tokenizer(text, add_special_tokens=False).input_ids == ids
  assert tokenizer(text).input_ids == [0] + ids  # documents start with the shifted-in id 0
  assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 0)
  generation = json.loads((out / "generation_config.json").read_text())
  assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)


@pytest.mark.parametrize("files", ["padding_at_0", "gpt2_like"])
def test_gpt2_bpe_tokenizer_json_encodes_like_sparsetx(tmp_path, files):
  """kind='gpt2' files, as sparsetx.tools.build_vocab writes them (<pad>=0) or GPT-2-like (id 0 is a text token)."""
  build_vocab.build_gpt2_bpe(str(tmp_path / "bpe"), 300, max_documents=100)
  if files == "gpt2_like":  # drop <pad>: <|endoftext|> takes id 0 and sparsetx moves it to the end
    vocab = json.loads((tmp_path / "bpe" / "vocab.json").read_text())
    (tmp_path / "bpe" / "vocab.json").write_text(json.dumps({t: i - 1 for t, i in vocab.items() if t != "<pad>"}))
  data = config_lib.data_defaults()
  data.vocab.update(kind="gpt2", path=str(tmp_path / "bpe"))
  (tmp_path / "hf").mkdir()
  tokenizer_files.write(data, 64, str(tmp_path / "hf"))
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  vocabulary = vocab_lib.make_vocabulary(data)
  text = "Once upon a time, Tom's dog ran!! <|endoftext|>Then wörld 🙂 <pad>"
  ids = list(vocabulary.encode(text))
  assert (files == "gpt2_like") == (vocabulary.eos_id == vocabulary.vocab_size - 1)  # the files' id 0 moved
  assert tokenizer(text, add_special_tokens=False).input_ids == ids
  assert tokenizer(text).input_ids == [0] + ids
  assert tokenizer.eos_token_id == vocabulary.eos_id
  assert tokenizer_files.vocab_of(str(tmp_path / "hf")).kind == "gpt2"


def test_sentencepiece_tokenizer_json_encodes_like_seqio(tmp_path):
  path = build_vocab.build_vocab(str(tmp_path / "spm"), 400, max_documents=200)  # BPE with byte fallback
  data = config_lib.data_defaults()
  data.vocab.update(kind="sentencepiece", path=path)
  (tmp_path / "hf").mkdir()
  tokenizer_files.write(data, 64, str(tmp_path / "hf"))
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  vocabulary = vocab_lib.make_vocabulary(data)
  for text in ("Once upon a time, Tom's dog ran!!  Then wörld 🙂 <pad></s><unk>", " leading space", "x\n\ny 12345  "):
    ids = list(vocabulary.encode(text))
    assert tokenizer(text, add_special_tokens=False).input_ids == ids
    assert tokenizer(text).input_ids == [0] + ids
    assert tokenizer.decode(ids) == vocabulary.decode(ids)
  assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
  assert tokenizer_files.vocab_of(str(tmp_path / "hf")).kind == "sentencepiece"


def test_bfloat16_export_rounds_each_weight_once(exported, tmp_path):
  config, params, _ = exported
  export.write_hf(config, params, str(tmp_path / "bf16"), dtype="bfloat16")
  _, imported_params = export.load_hf(str(tmp_path / "bf16"))
  assert_same_params(
    jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), params), imported_params
  )


def test_import_checkpoint_export_round_trip_and_trainer_resume(exported, tmp_path):
  config, params, out = exported
  workdir = tmp_path / "run"
  export.import_hf(str(out), str(workdir), config=config)
  summary = export.export(str(workdir), str(tmp_path / "again"))
  assert summary["step"] == 0 and summary["kind"] == "hf_neox"
  _, again = export.load_hf(str(tmp_path / "again"))
  assert_same_params(params, again)
  # The trainer's own start accepts the workdir: a step-0 start of the same model (no data position: the stream
  # starts at its beginning) whose parameters are read onto the mesh; the import wrote no optimizer state.
  checkpointer = checkpointing.Checkpointer(str(workdir), config.checkpoint)
  assert checkpointer.resume_step() == 0
  checkpointer.check_compatible(0, config)
  assert not (workdir / "checkpoints" / "0" / "data").exists()
  mesh = mesh_lib.make_mesh(config.mesh)
  abstract, _, _, _ = state_lib.state_shardings(config, mesh)
  assert_same_params(params, jax.device_get(checkpointer.restore_params(0, abstract.params)))
  with pytest.raises(checkpointing.CheckpointError, match=r"^checkpoint step 0 in .+ holds parameters only"):
    checkpointer.restore_state(0, abstract)
  checkpointer.close()


def test_import_from_gs_reads_each_shard_once_keeps_the_tokenizer_and_a_failed_read_leaves_nothing(tmp_path, fake_gcs):
  config = neox_config(vocab_size=512)
  config.data.vocab.update(
    kind="sentencepiece", path=build_vocab.build_vocab(str(tmp_path / "spm"), 400, max_documents=200)
  )
  params = random_params(config)
  cap = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(params)) // 4
  export.write_hf(config, params, str(fake_gcs / "bucket" / "hf"), max_shard_size=cap)  # the bucket's files
  fetched = []
  copy = type(epath.Path("gs://bucket")._backend).copy  # noqa: SLF001  (the fake store's copy)

  def counted(self, path, dst, overwrite):
    fetched.append(os.path.basename(os.fspath(path)))
    return copy(self, path, dst, overwrite)

  workdir = tmp_path / "run"
  with unittest.mock.patch.object(type(epath.Path("gs://bucket")._backend), "copy", counted):  # noqa: SLF001
    summary = export.import_hf("gs://bucket/hf", str(workdir), max_shard_size=cap)
  index = json.loads((fake_gcs / "bucket" / "hf" / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and sorted(n for n in fetched if n.endswith(".safetensors")) == shards  # each one once
  assert summary["config"].data.vocab.path == str(workdir / "tokenizer" / "tokenizer.model")
  saved_config, imported, step = checkpointing.load(str(workdir))  # the kept tokenizer passes the file checks
  assert step == 0 and saved_config.data.vocab.kind == "sentencepiece"
  assert_same_params(params, jax.device_get(imported))

  def failing_third(self, path, dst, overwrite):
    if "model-00003-of-" in os.fspath(path):
      raise OSError(errno.EIO, "Input/output error", os.fspath(path))
    return copy(self, path, dst, overwrite)

  with unittest.mock.patch.object(type(epath.Path("gs://bucket")._backend), "copy", failing_third):  # noqa: SLF001
    with pytest.raises(
      config_lib.ConfigError, match=r"^gs://bucket/hf/model-00003-of-\d{5}.safetensors cannot be read \(Input/output"
    ):
      export.import_hf("gs://bucket/hf", str(tmp_path / "run2"), max_shard_size=cap)
  assert sorted(os.listdir(tmp_path)) == ["buckets", "cwd", "run", "spm.model", "spm.vocab"]  # nothing staged left
  with pytest.raises(config_lib.ConfigError, match=r"^'gs://nobucket/hf' is not a directory"):
    export.import_hf("gs://nobucket/hf", str(tmp_path / "run3"))


def test_errors_are_one_clear_sentence_and_nothing_is_overwritten(exported, tmp_path):
  config, params, out = exported
  with pytest.raises(config_lib.ConfigError, match="holds no checkpoints/ directory"):
    export.export(str(tmp_path / "missing"), str(tmp_path / "x"))
  with pytest.raises(config_lib.ConfigError, match="is not a directory"):
    export.load_hf(str(tmp_path / "missing"))

  target = tmp_path / "busy"
  target.mkdir()
  (target / "notes.txt").write_text("mine")
  with pytest.raises(config_lib.ConfigError, match="already holds files; .* --overwrite"):
    export.write_hf(config, params, str(target))
  with pytest.raises(config_lib.ConfigError, match="not an earlier output"):
    export.write_hf(config, params, str(target), overwrite=True)
  assert os.listdir(target) == ["notes.txt"] and (target / "notes.txt").read_text() == "mine"
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging directory left behind

  before = (out / "model.safetensors").read_bytes()
  with pytest.raises(config_lib.ConfigError, match="already holds files"):
    export.write_hf(config, random_params(config, seed=3), str(out))
  assert (out / "model.safetensors").read_bytes() == before
  previous = tmp_path / "previous"  # --overwrite replaces an earlier export as a whole
  export.write_hf(config, params, str(previous))
  (previous / "stale.txt").write_text("from before")
  other = random_params(config, seed=3)
  export.write_hf(config, other, str(previous), overwrite=True)
  assert not (previous / "stale.txt").exists()
  assert_same_params(other, export.load_hf(str(previous))[1])

  sgatlin = load_config("configs/tiny.py", "sgatlin")
  with pytest.raises(config_lib.ConfigError, match=r"--kind=neox: .*ffn.type='sgatlin'"):
    export.write_hf(sgatlin, {}, str(tmp_path / "sparse"), kind="neox")
  rms = neox_config(norm="rmsnorm")
  assert "norm='rmsnorm'" in neox.unsupported_reason(rms.model)
  assert not (tmp_path / "sparse").exists()

  foreign = tmp_path / "foreign"
  foreign.mkdir()
  (foreign / "config.json").write_text(json.dumps(dict(model_type="llama")))
  with pytest.raises(config_lib.ConfigError, match="model_type='llama'"):
    export.load_hf(str(foreign))
  mismatched = json.loads((out / "config.json").read_text())
  mismatched["intermediate_size"] = 256
  with pytest.raises(config_lib.ConfigError, match="shape .* config.json implies"):
    neox.from_hf(mismatched, export.read_tensors(str(out)))
