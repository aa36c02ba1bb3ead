"""`ConfigError`, in a module of its own so every layer can raise it without importing the schema or checks.

The three helpers raise it with a message that names the dotted field; the checks of the config package
(and any per-type checks elsewhere) share them so one mistake always reads the same way.
"""


class ConfigError(ValueError):
  """A config value is wrong; the message names the field and how to fix it."""


def require(ok: bool, message: str) -> None:
  """Raises ConfigError(message) unless `ok`."""
  if not ok:
    raise ConfigError(message)


def one_of(name: str, value, choices) -> None:
  require(value in choices, f"{name}={value!r} is unknown; use one of {', '.join(map(repr, choices))}.")


def positive_int(name: str, value) -> None:
  require(isinstance(value, int) and value > 0, f"{name}={value!r} must be a positive integer.")
