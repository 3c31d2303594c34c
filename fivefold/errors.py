"""Errors a user can fix: the CLI prints their message and exits 2, without a traceback."""


class UserError(Exception):
    """Bad input (a config, a flag, a data file, a checkpoint): the message says what and how to fix it."""


class NotImplementedYet(UserError):
    """A knob that is parsed but not built yet: refused, never silently ignored."""

    def __init__(self, what: str):
        super().__init__(f"{what}: not implemented yet")
