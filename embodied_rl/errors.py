"""The one exception type for bad user input.

The CLI prints a UserError as one line and exits with code 2; any other exception is a bug and
keeps its traceback. It subclasses ValueError so library callers can catch it the usual way.
This module is a leaf: every layer may import it.
"""


class UserError(ValueError):
    """Bad input from the user: a config value, a path, a corrupt dataset or checkpoint."""
