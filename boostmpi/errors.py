"""Errors that end a command with a one-line message.

`UserError` is bad input (config, data, checkpoint, command line): exit status 2.
Anything else that escapes a command is an internal failure: exit status 1.
"""

from collections.abc import Iterator
from typing import TypeAlias


class UserError(Exception):
    """Bad input. The message is one line that names the problem."""

    exit_code = 2
    # set (never a class default) when every rank raises this error, rank 0 alone printing it: the
    # launcher reads its absence (getattr) as "all ranks" too
    all_ranks: bool


class ConfigError(UserError):
    """An unknown key, a wrong type or an impossible combination in the configuration."""


class DataError(UserError):
    """A token shard or text input that cannot be used."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, truncated or corrupted."""


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""


# ---------------------------------------------------------------- an error on any rank is an error on all ranks
#
# A rank that meets bad input while the others wait in a collective would leave them waiting. So the
# rank turns the error into a verdict, (class name, message), the ranks share the verdicts in one
# collective (`HostCollectives.agree`), and every rank raises the same error, marked `all_ranks`:
# each exits 2 and rank 0 alone prints the line.

Verdict: TypeAlias = tuple[str, str]
"""(class name of a UserError, its one-line message), as the ranks exchange it."""


def verdict_of(exc: UserError) -> Verdict:
    """(class name, one-line message) of a UserError, to send to the other ranks."""
    return (type(exc).__name__, str(exc))


def _kinds(cls: type[UserError] = UserError) -> Iterator[type[UserError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _kinds(sub)


def raised_on_all_ranks(verdict: Verdict) -> UserError:
    """The UserError of a verdict (its own class when this process knows it), marked as raised on every rank."""
    name, message = verdict
    exc = next((c for c in _kinds() if c.__name__ == name), UserError)(message)
    exc.all_ranks = True
    return exc
