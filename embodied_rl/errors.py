"""The exceptions the CLI turns into one line and an exit code.

UserError (bad input) exits with code 2, Diverged (training went non-finite) with code 3; any
other exception is a bug and keeps its traceback. UserError subclasses ValueError so library
callers can catch it the usual way. This module is a leaf: every layer may import it.
"""


class UserError(ValueError):
    """Bad input from the user: a config value, a path, a corrupt dataset or checkpoint."""


class Diverged(RuntimeError):
    """Training produced a non-finite loss, gradient or weight. The CLI prints it as one line and
    exits with code 3; the run's checkpoints/last is the last finite state."""
