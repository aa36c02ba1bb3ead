"""The command-line convention of every sparsetx program: one `error:` line and exit code 2.

More: docs/modules.md, sparsetx/cli.py.
"""

import contextlib
import difflib
import glob
import importlib.abc
import importlib.util
import logging as py_logging
import os
import re
import sys
import tempfile
import traceback
from types import SimpleNamespace

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_dict, config_flags
from ml_collections.config_flags import config_flags as config_flags_lib  # is_config_flag, the file loader

from sparsetx.config import ConfigError

USAGE_EXIT_CODE = 2
WATCHDOG_EXIT_CODE = 6  # a hang ended (the watchdog, an autotune candidate): the deploy/ recipes restart on it

_running = False  # inside `run`: a `fail` is the program's last word
_failed = False  # `fail` has printed its line inside `run`


def fail(error, code: int = USAGE_EXIT_CODE):
  """Ends the program with `error: <message>` as the one line on stderr (one write: no other thread's output
  can land inside it). Inside `run`, stderr is closed after it, and `run` exits without the teardown."""
  global _failed
  sys.stdout.flush()
  sys.stderr.write(f"error: {error}\n")
  sys.stderr.flush()
  if _running:
    _failed = True
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (the process ends in a moment)
  sys.exit(code)


def flag_values(holders: dict) -> SimpleNamespace:
  """The parsed values of a program's flags ({name: FlagHolder}, as its define_flags returns) as attributes."""
  return SimpleNamespace(**{name: holder.value for name, holder in holders.items()})


def run(main, *, forwards_after_dashdash: bool = False) -> None:
  """`app.run(main)`, with flag and config problems reported by `parse_flags`, words that are no flags
  refused (but those after `--` with `forwards_after_dashdash`), and `--help` listing `main`'s module's flags.
  A `fail` ends the process at once (`os._exit`): nothing prints after its line."""
  global _running
  _claim_flags_for_help(main)

  def parser(argv: list[str]) -> list[str]:
    args = parse_flags(argv)
    forwarded = argv[argv.index("--") + 1 :] if forwards_after_dashdash and "--" in argv else []
    stray = args[1 : len(args) - len(forwarded)]
    if stray:
      fail(_describe_stray(stray, argv))
    return args

  _running = True
  try:
    app.run(main, flags_parser=parser)
  except SystemExit as exit_info:
    if _failed:
      sys.stdout.flush()
      os._exit(exit_info.code if isinstance(exit_info.code, int) else 1)
    raise
  finally:
    _running = False


def _describe_stray(stray: list[str], argv: list[str]) -> str:
  """The one line for words that are no flags; after a list flag given with a space, the comma form."""
  words = " ".join(repr(word) for word in stray)
  hint = "every input is a --flag; see --help."
  at = argv.index(stray[0]) if stray[0] in argv else 0
  values = list(stray)
  for back in (1, 2):  # `--types=mlp sgatlin` or `--types mlp sgatlin`
    match = re.fullmatch(r"--?([\w.]+)(?:=(.*))?", argv[at - back], re.S) if at - back > 0 else None
    if match:
      value = match.group(2) if back == 1 else argv[at - 1]
      flag = flags.FLAGS[match.group(1)] if match.group(1) in flags.FLAGS else None
      if value is not None and flag is not None and isinstance(flag.parser, flags.ListParser):
        hint = f"a list flag takes commas: --{match.group(1)}={','.join([value, *values])}."
      break
  return f"unexpected argument{'s' if len(stray) > 1 else ''} {words}: {hint}"


def _claim_flags_for_help(main) -> None:
  """Makes the flags of `main`'s module key flags of the program (`sys.argv[0]`), which `--help` lists: a
  console script or a `python -m` wrapper runs a `main` defined in another module."""
  module = getattr(main, "__module__", None)
  if module in (None, "__main__"):
    return
  for flag in flags.FLAGS.get_flags_for_module(module):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def _disclaim() -> None:
  """Flags defined through this module's helpers belong to the module that calls them, so that `--help` lists them
  with that program's other flags (absl keeps one set of disclaimed modules; adding this one again changes nothing)."""
  flags.disclaim_key_flags()


def define_config_file(
  name: str, default: str | None, help_string: str, flag_values: flags.FlagValues = flags.FLAGS, **kwargs
) -> flags.FlagHolder:
  """`config_flags.DEFINE_config_file` whose default is loaded when the flags are parsed, not here.

  ml_collections loads a default config file (and applies the command line's overrides to it) while the
  flag is defined, at import, where no parser can catch a bad override; `config_args` passes the default
  as if given on the command line instead.
  """
  _disclaim()
  holder = config_flags.DEFINE_config_file(
    name, None, help_string + (f" Default: {default}." if default else ""), flag_values=flag_values, **kwargs
  )
  flag_values[name].default_spec = default
  return holder


def load_config_file(name: str, spec: str) -> config_dict.ConfigDict:
  """The config a `--NAME=spec` ('path[:arg]') flag would load, loaded here (a program that loads one file for each
  of several arguments); a missing file or a get_config that raises is a one-sentence ConfigError."""
  _check_config_file(name, spec)
  try:
    return config_flags_lib.ConfigFileFlagParser(name, lock_config=False).parse(spec)
  except Exception as error:  # noqa: BLE001  (described in one sentence, as config_args does)
    innermost = _chain(error)[-1]
    if isinstance(innermost, ConfigError):  # raised by the config file, which names itself or not
      message = str(innermost)
      raise ConfigError(
        message if message.startswith(spec.split(":", 1)[0]) else f"--{name}={spec}: {message}"
      ) from None
    raise ConfigError(_describe_load_error(name, spec, innermost)) from None


class _IntegerListParser(flags.ListParser):
  """Comma-separated integers (`--scales=2,4`)."""

  def parse(self, argument):
    values = super().parse(argument)
    try:
      return [int(value) for value in values]
    except (TypeError, ValueError):
      raise ValueError(f"{argument!r} is not a comma-separated list of integers") from None

  def flag_type(self) -> str:
    return "integer list"


def define_integer_list(
  name: str, default: list[int] | None, help_string: str, flag_values: flags.FlagValues = flags.FLAGS
) -> flags.FlagHolder:
  """A flag holding a comma-separated list of integers (absl has it for strings only: `DEFINE_list`)."""
  _disclaim()
  return flags.DEFINE(
    _IntegerListParser(), name, default, help_string, flag_values, serializer=flags.CsvListSerializer(",")
  )


def parse_flags(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
  """Parses `argv` into `flag_values` (an `app.run` flags parser); a problem ends the program via `fail`."""
  try:
    return config_args(argv, flag_values)
  except ConfigError as error:
    fail(error)


def config_args(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
  """Parses `argv` into `flag_values`; returns the arguments left over. Raises `ConfigError` in one
  sentence for a bad config file, override, flag or value (what `parse_flags` prints)."""
  config_names = [name for name in flag_values if config_flags_lib.is_config_flag(flag_values[name])]
  for name in config_names:
    default = getattr(flag_values[name], "default_spec", None)  # see define_config_file
    if default and not any(re.fullmatch(rf"--?{name}(=.*)?", arg, re.S) for arg in argv[1:]):
      argv = [argv[0], f"--{name}={default}", *argv[1:]]
    _check_config_file(name, _config_spec(argv, name, flag_values))
  try:
    return flag_values(argv)
  except Exception as error:  # noqa: BLE001  (each kind is described below; the rest re-raised)
    raise ConfigError(_describe(error, argv, flag_values, config_names)) from None


def _config_spec(argv: list[str], name: str, flag_values: flags.FlagValues) -> str | None:
  """The `--NAME` config argument ('path[:arg]') given last in argv, else the flag's default."""
  spec = None
  for i, arg in enumerate(argv):
    if re.fullmatch(rf"--?{name}=.*", arg, re.S):
      spec = arg.split("=", 1)[1]
    elif re.fullmatch(rf"--?{name}", arg) and i + 1 < len(argv):
      spec = argv[i + 1]
  if spec is None:
    try:
      spec = config_flags.get_config_filename(flag_values[name])
    except (flags.Error, AttributeError):  # no default: the flag is optional and not given
      return None
  return spec


def _check_config_file(name: str, spec: str | None) -> None:
  if spec is None:
    return
  path = spec.split(":", 1)[0]
  if not os.path.isfile(path):
    raise ConfigError(
      f"--{name}={spec}: no such file {path!r} (relative paths start from {os.getcwd()}); "
      "give a config file such as configs/tiny.py."
    )


def _chain(error: BaseException) -> list[BaseException]:
  """`error` and the exceptions it was raised from or during, outermost first."""
  chain = []
  while error is not None and error not in chain:
    chain.append(error)
    error = error.__cause__ or error.__context__
  return chain


def _while_loading(error: BaseException) -> bool:
  """Raised while the config file was executed (ml_collections' loader on the stack)."""
  loader = config_flags_lib.ConfigFileFlagParser.parse.__code__
  return any(frame.f_code is loader for frame, _ in traceback.walk_tb(error.__traceback__))


def _describe(error: Exception, argv: list[str], flag_values: flags.FlagValues, config_names: list[str]) -> str:
  chain = _chain(error)
  innermost = chain[-1]
  loading = any(_while_loading(e) for e in chain)
  name = config_names[0] if config_names else "config"
  spec = _config_spec(argv, name, flag_values) if config_names else None
  if isinstance(innermost, ConfigError):  # raised inside the config file (e.g. an unknown ':ARG') or by a parser
    message = str(innermost)
    path = (spec or "").split(":", 1)[0]
    return message if not spec or message.startswith(path) else f"--{name}={spec}: {message}"
  if loading and spec is not None:
    return _describe_load_error(name, spec, innermost)
  if isinstance(innermost, (KeyError, AttributeError)) and config_names:
    unknown = _unknown_override(argv, config_names, flag_values)
    if unknown:
      return unknown
  if isinstance(error, flags.UnrecognizedFlagError):
    close = difflib.get_close_matches(error.flagname, list(flag_values), n=1)
    hint = f"did you mean --{close[0]}?" if close else "see --helpshort for the flags."
    return f"--{error.flagname} is not a flag of this program; {hint}"
  if isinstance(error, flags.IllegalFlagValueError):
    return _describe_bad_value(str(error), flag_values)
  if isinstance(error, flags.Error):
    return f"{str(error).strip().splitlines()[0]}; see --helpshort for the flags."
  raise error


def _describe_load_error(name: str, spec: str, error: BaseException) -> str:
  path = spec.split(":", 1)[0]
  if isinstance(error, SyntaxError):
    return (
      f"--{name}={spec}: syntax error in {error.filename or path} line {error.lineno} ({error.msg}); "
      "fix the config file."
    )
  where = [
    frame
    for frame in traceback.extract_tb(error.__traceback__)
    if os.path.abspath(frame.filename) == os.path.abspath(path)
  ]
  location = f" at {path} line {where[-1].lineno}" if where else ""
  arg = f"({spec.split(':', 1)[1]!r})" if ":" in spec else "()"
  reason = str(error).strip().splitlines()[-1] if str(error).strip() else ""
  return (
    f"--{name}={spec}: get_config{arg} raised {type(error).__name__}{location}"
    f"{': ' + reason if reason else ''}; fix the config file or its ':ARG'."
  )


def _unknown_override(argv: list[str], config_names: list[str], flag_values: flags.FlagValues) -> str | None:
  """The first `--NAME.a.b=...` override naming a field the config lacks, with the nearest field name."""
  for name in config_names:
    overrides = [m.group(2) for arg in argv if (m := re.match(rf"--?(no)?{name}\.([^=\s]+)", arg))]
    if not overrides:
      continue
    config = config_flags_lib.ConfigFileFlagParser(name, lock_config=False).parse(_config_spec(argv, name, flag_values))
    for override in overrides:
      node, walked = config, name
      for part in override.split("."):
        if not isinstance(node, (config_dict.ConfigDict, dict)):
          return (
            f"--{name}.{override}: {walked} is a value ({node!r}), not a section with a field {part!r}; "
            f"set --{walked}=VALUE instead."
          )
        if part == "gpu_kernel" and walked.endswith(".kernel"):  # retired: one knob names the implementation
          return (
            f"--{name}.{override}: kernel.gpu_kernel is retired; one knob names the implementation on every "
            f"platform: --{walked}.implementation=NAME (e.g. mosaic, triton, or 'triton,tpu')."
          )
        if part not in node:
          fields = sorted(node.keys())
          close = difflib.get_close_matches(part, fields, n=1)
          hint = f"did you mean --{walked}.{close[0]}?" if close else f"its fields are {', '.join(fields)}."
          return f"--{name}.{override}: {walked} has no field {part!r}; {hint}"
        node, walked = node[part], f"{walked}.{part}"
  return None


def _describe_bad_value(message: str, flag_values: flags.FlagValues) -> str:
  """`--FIELD=VALUE` whose value does not parse as the field's type, with the type and the current value."""
  match = re.match(r"flag --([^=]+)=(.*?): (.*)", message, re.S)
  if not match:
    return f"{message.strip().splitlines()[0]}; see --helpshort for the flags."
  flag_name, value, reason = match.groups()
  reason = reason.strip().splitlines()[0]
  flag = flag_values[flag_name] if flag_name in flag_values else None
  if value == "None" and "must have a value other than None" in reason:  # a required flag not given
    return f"--{flag_name} is required: {flag.help if flag is not None else 'give it a value'}"
  kind = _KINDS.get(flag.flag_type() if flag is not None else None)
  default = flag.default if flag is None or not isinstance(flag.default, list) else ",".join(map(str, flag.default))
  example = f" such as --{flag_name}={default}" if flag is not None and flag.default is not None else ""
  if kind is None:
    return f"--{flag_name}={value!r} is not a valid value ({reason}); give one{example}."
  return f"--{flag_name}={value!r} is not {kind}; give one{example}."


_KINDS = {
  "int": "an integer",
  "float": "a number",
  "bool": "true or false",
  "string": "a string",
  "integer list": "a comma-separated list of integers",
}


# The quiet console (see the module docstring), set up when a program imports this module, before TensorFlow.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# TensorFlow's C++ start-up lines on any machine: notices, and the CUDA probing of a machine without a GPU.
TENSORFLOW_NOISE = re.compile(
  r"All log messages before absl::InitializeLog\(\) is called are written to STDERR"
  r"|oneDNN custom operations are on"
  r"|Could not find cuda drivers on your machine"
  r"|failed call to cuInit"
  r"|This TensorFlow binary is optimized to use available CPU instructions"
  r"|^To enable the following instructions: .*rebuild TensorFlow"
  r"|Unable to register cu(DNN|FFT|BLAS) factory"
  r"|TF-TRT Warning: Could not find TensorRT"
)


class _LibraryInfoFilter(py_logging.Filter):
  """Drops the INFO (and DEBUG) records of every library on the console; sparsetx's own and the running
  program's stay, and an explicit `--verbosity` (absl's flag, also `-v`) shows everything it asks for."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno >= py_logging.WARNING or "verbosity" in flags.FLAGS and flags.FLAGS["verbosity"].present:
      return True
    path = os.path.abspath(record.pathname)
    return path.startswith(_PACKAGE_DIR) or path == os.path.abspath(sys.argv[0])


@contextlib.contextmanager
def stderr_without(noise: re.Pattern):
  """Captures what is written to file descriptor 2 (C++ libraries included) inside the block, then writes
  it back without the lines `noise` matches."""
  sys.stderr.flush()
  try:
    saved = os.dup(2)
  except OSError:  # no stderr to filter
    yield
    return
  with tempfile.TemporaryFile() as capture:
    os.dup2(capture.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      capture.seek(0)
      lines = capture.read().decode(errors="replace").splitlines(keepends=True)
      kept = "".join(line for line in lines if not noise.search(line))
      if kept:
        sys.stderr.write(kept)
        sys.stderr.flush()


class _QuietTensorFlowLoader(importlib.abc.Loader):
  """TensorFlow's own loader, run with its C++ start-up noise filtered and its GPUs hidden (see below)."""

  def __init__(self, loader):
    self._loader = loader

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module) -> None:
    with stderr_without(TENSORFLOW_NOISE):
      self._loader.exec_module(module)
      try:  # lists the devices (TensorFlow's CUDA probing, filtered here) and keeps TensorFlow off the GPUs
        module.config.set_visible_devices([], "GPU")
      except (RuntimeError, ValueError):  # already initialized by its importer, or no GPU support built in
        pass

  def __getattr__(self, name):
    return getattr(self._loader, name)


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder):
  """Imports `tensorflow`, whoever imports it first (seqio, clu, tfds, sparsetx), through
  `_QuietTensorFlowLoader`: a GPU that exists stays JAX's, and nothing of the machine is disabled for JAX."""

  _looking = False  # the lookup below asks every finder again, this one included

  def find_spec(self, fullname, path, target=None):
    if fullname != "tensorflow" or self._looking:
      return None
    self._looking = True
    try:
      spec = importlib.util.find_spec(fullname)
    finally:
      self._looking = False
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietTensorFlowLoader(spec.loader)
    return spec


def present_platforms() -> str:
  """The JAX platforms this machine has, for JAX_PLATFORMS when it is unset: a TPU where the kernel exposes its
  chips (/dev/accel*, /dev/vfio), a GPU where the NVIDIA driver is loaded, then the CPU. The test extras install
  libtpu and the CUDA plugin (to compile for those targets); initializing them on a machine without the chips
  would print their start-up failures (and make libtpu ask the cloud's metadata server)."""
  found = []
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    found.append("tpu")
  if os.path.exists("/proc/driver/nvidia/version"):
    found.append("cuda")
  return ",".join([*found, "cpu"])


def quiet_console() -> None:
  """What every program needs before its heavy imports (sparsetx/tools/__init__.py calls it): JAX_PLATFORMS set to
  the platforms present, the libraries' INFO logs filtered, TensorFlow's start-up notices filtered at its import.
  Importing this module changes none of it."""
  platforms = os.environ.setdefault("JAX_PLATFORMS", present_platforms())
  if "jax" in sys.modules:  # a program that imported jax first: jax read the variable (unset) at its import
    sys.modules["jax"].config.update("jax_platforms", platforms)
  absl_logging.get_absl_handler().addFilter(_LibraryInfoFilter())
  if "tensorflow" not in sys.modules and not any(isinstance(f, _QuietTensorFlowImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _QuietTensorFlowImport())
