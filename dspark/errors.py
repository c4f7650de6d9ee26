"""Errors a user can act on. Each says which input was wrong, its value, and what is allowed."""

import reprlib

MAX_SHOWN = 200  # characters of a value that an error message shows


class DSparkError(Exception):
    """Base class for every error dspark raises on purpose."""


class ConfigError(DSparkError, ValueError):
    """An invalid setting: names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={shown(value)} is invalid: {allowed}")


class ModelLoadError(DSparkError):
    """A model or tokenizer could not be found, read or understood."""


class EngineError(DSparkError):
    """The engine failed while running this request (a step raised); the log (the server's, or the engine core
    process's) has the traceback."""


class EngineDeadError(EngineError):
    """The engine has stopped (shut down, or died): no request can run."""


class _Shown(reprlib.Repr):
    """reprlib's bounded repr (it cuts long strings and containers, and stops at a depth, so a 16 MB string or a list
    nested a thousand deep costs little), which also shows an int too long for repr() to print at all (past
    sys.get_int_max_str_digits(), repr raises ValueError)."""

    def __init__(self) -> None:
        super().__init__()  # limits as attributes: Python 3.11's Repr takes no arguments
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 4, MAX_SHOWN, MAX_SHOWN, MAX_SHOWN
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 10

    def repr_int(self, x: int, level: int) -> str:
        try:
            return super().repr_int(x, level)
        except ValueError:
            return f"<an integer of {x.bit_length()} bits>"


_SHOWN = _Shown()


def shown(value: object) -> str:
    """repr(value) for an error message: at most MAX_SHOWN characters, whatever the value."""
    text = _SHOWN.repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."
