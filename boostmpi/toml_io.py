"""The TOML files of boostmpi: reading one with a one-line error, and writing the subset a configuration
or a machine profile needs (one level of tables of scalars)."""

import math
import os
from pathlib import Path

import tomllib

from boostmpi.errors import ConfigError


def read_toml(path: str | os.PathLike[str], what: str = "config file",
              error: type[Exception] = ConfigError) -> dict[str, object]:
    """A TOML file as a dict; a missing, unreadable or invalid file is one `error` naming it."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise error(f"{what} {path} not found") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{what} {path} is not valid TOML: {' '.join(str(exc).split())}") from None


_STRING_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_value(value: object) -> str:
    """`value` (bool, int, float or str) as TOML writes it; the float as the shortest text that reads back equal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest text that reads back to the same float
    if isinstance(value, str):
        escaped = (_STRING_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ch < " " or ch == "\x7f" else ch)
                   for ch in value)
        return '"' + "".join(escaped) + '"'
    return repr(value)  # only in messages about values of a wrong type
