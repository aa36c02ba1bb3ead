"""Every bad command-line input ends in one `error:` line with exit code 2, before anything is built
(sparsetx/cli.py): config files, overrides, values, flags, and non-finite hyperparameters.

The parsing is tested in-process on flags defined as `python -m sparsetx.train` defines them; three
subprocess runs check that the programs themselves are wired to it.
"""

import os
import subprocess
import sys

import jax
import pytest
from absl import flags
from conftest import REPO

from sparsetx import cli
from sparsetx import config as config_lib


def parse(*args: str):
  """(config, workdir) as `python -m sparsetx.train ARGS` parses them (its config and workdir flags)."""
  argv = ["sparsetx.train", *args]
  values = flags.FlagValues()
  config = cli.define_config_file(
    "config", "configs/tiny.py", "Config file.", flag_values=values, lock_config=True, sys_argv=argv
  )
  workdir = flags.DEFINE_string("workdir", None, "Directory for checkpoints.", flag_values=values, required=True)
  cli.parse_flags(argv, values)
  return config.value, workdir.value


def one_error_line(capsys, *args: str) -> str:
  """The single stderr line of a parse that must fail with exit code 2."""
  with pytest.raises(SystemExit) as exit_info:
    parse(*args)
  assert exit_info.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  return lines[0]


@pytest.fixture
def bad_config_files(tmp_path):
  (tmp_path / "syntax.py").write_text("def get_config(:\n  pass\n")
  (tmp_path / "raises.py").write_text("def get_config():\n  return {}['model']\n")
  return tmp_path


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
  monkeypatch.chdir(REPO)  # config paths are relative to the repository, as in the README


@pytest.mark.parametrize(
  "args, message",
  [
    (
      ["--config.train.stepz=10"],
      "error: --config.train.stepz: config.train has no field 'stepz'; did you mean --config.train.steps?",
    ),
    (["--config.trian.steps=10"], "config has no field 'trian'; did you mean --config.train?"),
    (["--config.train.steps.x=1"], "config.train.steps is a value (300), not a section"),
    (
      ["--config.model.ffn.kernel.gpu_kernel=mosaic"],
      "error: --config.model.ffn.kernel.gpu_kernel: kernel.gpu_kernel is retired; one knob names the "
      "implementation on every platform: --config.model.ffn.kernel.implementation=NAME",
    ),
    (
      ["--config.train.steps=ten"],
      "error: --config.train.steps='ten' is not an integer; give one such as --config.train.steps=300.",
    ),
    (["--config.train.learning_rate=abc"], "--config.train.learning_rate='abc' is not a number"),
    (["--config=configs/tiny.py:bogus"], "error: configs/tiny.py:bogus names an unknown feed-forward type; use one of"),
    (["--config=configs/nope.py"], "error: --config=configs/nope.py: no such file 'configs/nope.py'"),
    (["--workdirr=x"], "error: --workdirr is not a flag of this program; did you mean --workdir?"),
    ([], "error: --workdir is required: Directory for checkpoints."),
    (
      ["--config.train.steps=3", "--config=configs/tiny.py"],
      "--config.train.steps=3 in argv before a value for --config",
    ),
  ],
)
def test_bad_flag_is_one_error_line(capsys, args, message):
  args = args if any(a.startswith("--workdir") for a in args) or not args else [*args, "--workdir=/nonexistent/w"]
  assert message in one_error_line(capsys, *args)


def test_bad_config_file_is_one_error_line(capsys, bad_config_files):
  line = one_error_line(capsys, f"--config={bad_config_files}/syntax.py", "--workdir=w")
  assert line == (
    f"error: --config={bad_config_files}/syntax.py: syntax error in {bad_config_files}/syntax.py line 1 "
    "(invalid syntax); fix the config file."
  )
  line = one_error_line(capsys, f"--config={bad_config_files}/raises.py", "--workdir=w")
  assert line == (
    f"error: --config={bad_config_files}/raises.py: get_config() raised KeyError at "
    f"{bad_config_files}/raises.py line 2: 'model'; fix the config file or its ':ARG'."
  )
  line = one_error_line(capsys, f"--config={bad_config_files}/raises.py:x", "--workdir=w")
  assert "get_config('x') raised TypeError: get_config() takes 0 positional arguments" in line


@pytest.mark.parametrize(
  "override, message",
  [
    ("train.learning_rate=inf", "config.train.learning_rate=inf is not a finite number"),
    ("train.learning_rate=nan", "config.train.learning_rate=nan is not a finite number"),
    ("train.weight_decay=-inf", "config.train.weight_decay=-inf is not a finite number"),
    ("mesh.max_replicated_mib=inf", "config.mesh.max_replicated_mib=inf is not a finite number"),
    ("train.steps=0", "config.train.steps=0 must be a positive integer"),
    ("data.global_batch_size=-8", "config.data.global_batch_size=-8 must be a positive integer"),
    ("train.warmup_steps=-1", "config.train.warmup_steps=-1 must be an integer >= 0"),
    ("checkpoint.keep=0", "config.checkpoint.keep=0 must be a positive integer"),
    ("checkpoint.restore_step=-1", "config.checkpoint.restore_step=-1 must be a saved step"),
    ("model.ffn.type=dense", "config.model.ffn.type='dense' is unknown"),
    ("model.ffn.d_ffw=1000", "config.model.ffn.d_ffw=1000 must be a perfect square"),
    ("model.ffn.top_k=40", "config.model.ffn.top_k=40 must be smaller than sqrt(d_ffw)=32"),
    ("train.bad_steps=ignore", "config.train.bad_steps='ignore' is unknown; use one of 'stop', 'skip', 'rollback'"),
    ("train.spike_sigmas=0.0", "config.train.spike_sigmas=0.0 must be a positive number"),
    ("train.spike_sigmas=-6.0", "config.train.spike_sigmas=-6.0 must be a positive number"),
    ("train.spike_window=0", "config.train.spike_window=0 must be a positive integer"),
    ("train.max_bad_in_row=0", "config.train.max_bad_in_row=0 must be a positive integer"),
    ("train.max_rollbacks=-1", "config.train.max_rollbacks=-1 must be an integer >= 0"),
    ("data.skip_steps=30:20", "window '30:20' needs 1 <= START <= END"),
    ("data.skip_steps=0:5", "window '0:5' needs 1 <= START <= END"),
    ("data.skip_steps=40:50,10:20", "window '10:20' starts at or before the end of the one before it"),
    ("data.skip_steps=40:50,45:60", "window '45:60' starts at or before the end of the one before it"),
    ("data.skip_steps=10-20", "'10-20' is not a window 'START:END'"),
    ("train.step_timeout_s=-1.0", "config.train.step_timeout_s=-1.0 must be seconds >= 0"),
    ("checkpoint.every_minutes=-5.0", "config.checkpoint.every_minutes=-5.0 must be minutes >= 0"),
    ("train.usage_window=0", "config.train.usage_window=0 must be a multiple of config.train.log_every=20 in"),
    ("train.usage_window=330", "config.train.usage_window=330 must be a multiple of config.train.log_every=20 in"),
    ("train.usage_window=600", "config.train.usage_window=600 must be a multiple of config.train.log_every=20 in"),
    ("metrics.wandb.mode=offline", "config.metrics.wandb.mode='offline' needs a W&B project: give"),
    ("metrics.wandb.mode=cloud", "config.metrics.wandb.mode='cloud' is unknown; use one of '', 'online', 'offline'"),
    # configs/tiny.py's 300 steps read batches up to 300, and up to 311 once 1:11 is stepped over.
    ("data.skip_steps=301:400", "window 301:400 lies outside the run, whose 300 steps"),
    ("data.skip_steps=1:11,312:320", "window 312:320 lies outside the run, whose 300 steps"),
  ],
)
def test_bad_value_is_refused_by_validation(override, message):
  config, _ = parse(f"--config.{override}", "--workdir=w")
  with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    config_lib.validate(config)


def test_good_flags_parse():
  config, workdir = parse(
    "--config=configs/tiny.py:fff",
    "--config.train.steps=7",
    "--config.train.learning_rate=3e-4",
    "--config.checkpoint.restore_step=2",
    "--workdir=w",
  )
  assert (config.model.ffn.type, config.train.steps, config.train.learning_rate) == ("fff", 7, 3e-4)
  assert config.checkpoint.restore_step == 2 and workdir == "w"
  config_lib.validate(config)
  assert parse("--workdir=w")[0].checkpoint.restore_step is None  # default: the newest step


def run(*command: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
  "command, message",
  [
    (["-m", "sparsetx.train", "--config.train.stepz=10"], "did you mean --config.train.steps?"),
    (
      ["-m", "sparsetx.train", "--config.train.learning_rate=inf"],
      "config.train.learning_rate=inf is not a finite number",
    ),
    (["-m", "sparsetx.train", "--config.data.skip_steps=9:3"], "config.data.skip_steps='9:3': window '9:3'"),
    (
      ["-m", "sparsetx.tools.export", "--config=configs/nope.py", "--import_from=x"],
      "--config=configs/nope.py: no such file",
    ),
  ],
)
def test_programs_report_one_line_and_exit_2(tmp_path, command, message):
  workdir = tmp_path / "never"
  result = run(*command, f"--workdir={workdir}")
  assert result.returncode == 2, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.stderr, result.stderr
  assert not workdir.exists() and not os.listdir(tmp_path)


@pytest.mark.parametrize(
  "command, line",
  [
    (
      ["-m", "sparsetx.tools.bench_train_step", "--types", "mlp", "sgatlin", "fff"],
      "error: unexpected arguments 'sgatlin' 'fff': a list flag takes commas: --types=mlp,sgatlin,fff.",
    ),
    (
      ["-m", "sparsetx.train", "--workdir=never", "stray"],
      "error: unexpected argument 'stray': every input is a --flag; see --help.",
    ),
  ],
)
def test_stray_words_are_one_line_and_exit_2(command, line):
  """absl leaves the words that are no flags to main; cli.run refuses them before anything runs."""
  result = run(*command)
  assert result.returncode == 2 and result.stderr == line + "\n", result.stderr
  assert not (REPO / "never").exists()


@pytest.mark.parametrize(
  "module, flag",
  [
    ("sparsetx.tools.bench_top_k", "--scales"),  # defined with cli.define_integer_list
    ("sparsetx.tools.dry_run", "--config"),  # cli.define_config_file
    ("sparsetx.tools.train", "--workdir"),  # `python -m sparsetx.train` runs this program
  ],
)
def test_help_lists_the_programs_own_flags(module, flag):
  result = run("-m", module, "--help")  # (absl's --help exits with 1)
  assert f"\n  {flag}:" in result.stdout and "sparsetx.cli:" not in result.stdout, result.stdout


def test_library_info_logs_are_dropped_unless_verbosity_is_given(monkeypatch):
  """The console filter on absl's handler: sparsetx's INFO and every library's WARNING pass, a library's INFO
  (orbax's checkpoint chatter) only with an explicit --verbosity."""
  import logging

  def record(path: str, level: int) -> logging.LogRecord:
    return logging.LogRecord("absl", level, path, 1, "message", None, None)

  orbax = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
  ours = str(REPO / "sparsetx" / "train" / "loop.py")
  console = cli._LibraryInfoFilter()
  assert not console.filter(record(orbax, logging.INFO))
  assert console.filter(record(orbax, logging.WARNING)) and console.filter(record(ours, logging.INFO))
  monkeypatch.setattr(flags.FLAGS["verbosity"], "present", 1)
  assert console.filter(record(orbax, logging.INFO))


def test_stderr_without_drops_only_the_noise_lines(capfd):
  """What C++ libraries write to file descriptor 2 (TensorFlow's start-up notices) is filtered line by line."""
  with cli.stderr_without(cli.TENSORFLOW_NOISE):
    os.write(2, b"E0000 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\n")
    os.write(2, b"a real problem\n")
    os.write(2, b"I0000 port.cc:153] oneDNN custom operations are on. You may see ...\n")
  assert capfd.readouterr().err == "a real problem\n"


def test_a_program_that_imports_jax_first_initializes_only_the_present_platforms():
  """A tool imports jax before its console is set up (import order); with JAX_PLATFORMS unset, jax read it at its
  import, so quiet_console sets jax's config too: on a machine without a GPU or TPU the CUDA plugin and libtpu never
  start (they would print their start-up failures)."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  code = "import jax\nimport sparsetx.tools\nprint(jax.config.jax_platforms, jax.devices()[0].platform)"
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == [cli.present_platforms(), jax.devices()[0].platform], result.stdout
  if cli.present_platforms() == "cpu":
    assert "cuInit" not in result.stderr and "libtpu" not in result.stderr, result.stderr[-2000:]


def test_importing_cli_changes_nothing_global():
  """sparsetx.cli is a library: importing it sets no environment variable, installs no import hook, adds no log
  filter and disclaims no flags; a program sets up its console when it loads (sparsetx/tools/__init__.py)."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  code = (
    "import os, sys\nfrom absl import flags, logging\nfrom absl.flags import _helpers\n"
    "from ml_collections import config_flags  # a library cli uses: it disclaims itself at its own import\n"
    "hooks, filters, disclaimed = list(sys.meta_path), list(logging.get_absl_handler().filters), "
    "set(_helpers.disclaim_module_ids)\n"
    "from sparsetx import cli\n"
    "assert 'JAX_PLATFORMS' not in os.environ, 'JAX_PLATFORMS'\n"
    "assert sys.meta_path == hooks, 'meta_path'\n"
    "assert logging.get_absl_handler().filters == filters, 'filters'\n"
    "assert set(_helpers.disclaim_module_ids) == disclaimed, 'disclaimed'\n"
    "import sparsetx.tools\n"
    "assert os.environ['JAX_PLATFORMS'] and sys.meta_path != hooks\n"
    "print('ok')"
  )
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_load_config_file_loads_what_the_flag_would(monkeypatch):
  """cli.load_config_file (a program loading one file per argument, bench_sampling): the file's get_config(arg),
  and a missing file or an argument the file refuses as one sentence naming the flag or the file."""
  monkeypatch.chdir(REPO)
  assert cli.load_config_file("config", "configs/tiny.py:fff").model.ffn.type == "fff"
  with pytest.raises(config_lib.ConfigError, match=r"^--config=configs/nope.py:mlp: no such file 'configs/nope.py'"):
    cli.load_config_file("config", "configs/nope.py:mlp")
  with pytest.raises(config_lib.ConfigError, match=r"^configs/tiny.py:bogus names an unknown feed-forward type"):
    cli.load_config_file("config", "configs/tiny.py:bogus")
