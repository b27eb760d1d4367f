"""Errors that end a command with a one-line message.

`UserError` is bad input (config, data, checkpoint, command line): exit status 2.
Anything else that escapes a command is an internal failure: exit status 1.
"""


class UserError(Exception):
    """Bad input. The message is one line that names the problem."""

    exit_code = 2


class ConfigError(UserError):
    """An unknown key, a wrong type or an impossible combination in the configuration."""


class DataError(UserError):
    """A token shard or text input that cannot be used."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, truncated or corrupted."""


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""
