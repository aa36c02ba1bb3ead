"""The command-line convention of every sparsetx program: one `error:` line and exit code 2.

`run(main)` is `absl.app.run` with `parse_flags` as its flags parser, and `define_config_file` the
`--config` flag it parses. absl and ml_collections' `config_flags` load the `--config` file and
apply the `--config.FIELD=VALUE` overrides while the flags are parsed, before `main` runs, and
report their failures as tracebacks or usage dumps with exit code 1. `parse_flags` catches them and says in one sentence what is wrong, naming the file or
the field, and how to fix it: a missing config file, a syntax error or an exception inside it (its
own `ConfigError` for an unknown `:ARG` included), an override of a field the config does not have
(with the nearest name), a value of the wrong type, an unknown flag. Nothing has been built then.
`main` reports the errors it finds later (`ConfigError`, checkpoint problems) with `fail`.
"""

import difflib
import os
import re
import sys
import traceback

from absl import app, flags
from ml_collections import config_dict, config_flags
from ml_collections.config_flags import config_flags as config_flags_lib  # is_config_flag, the file loader

from sparsetx.config import ConfigError

USAGE_EXIT_CODE = 2


def fail(error, code: int = USAGE_EXIT_CODE):
  """Ends the program with `error: <message>` as the one line on stderr."""
  print(f"error: {error}", file=sys.stderr)
  sys.exit(code)


def run(main) -> None:
  """`app.run(main)`, with flag and config problems reported by `parse_flags`."""
  app.run(main, flags_parser=parse_flags)


def define_config_file(
  name: str, default: str | None, help_string: str, flag_values: flags.FlagValues = flags.FLAGS, **kwargs
) -> flags.FlagHolder:
  """`config_flags.DEFINE_config_file` whose default is loaded when the flags are parsed, not here.

  ml_collections loads a default config file (and applies the command line's overrides to it) while the
  flag is defined, at import, where no parser can catch a bad override; `config_args` passes the default
  as if given on the command line instead.
  """
  holder = config_flags.DEFINE_config_file(
    name, None, help_string + (f" Default: {default}." if default else ""), flag_values=flag_values, **kwargs
  )
  flag_values[name].default_spec = default
  return holder


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
