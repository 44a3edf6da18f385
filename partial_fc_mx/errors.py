"""The base of the errors users see.

Each concept raises its own subclass from its own module (`DataError` in `data`,
`ConfigError` in `config`, `CheckpointError` in `checkpoint`, ...), and the command
line catches this one base: such an error is printed as its message, which names the
file, record or key and how to fix it, never as a traceback.
"""


class UserError(Exception):
    """A problem with the input (a file, a value, a setting), not a bug in the program."""
