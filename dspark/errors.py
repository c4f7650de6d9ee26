"""Errors a user can act on. Each says which input was wrong, its value, and what is allowed."""


class DSparkError(Exception):
    """Base class for every error dspark raises on purpose."""


class ConfigError(DSparkError, ValueError):
    """An invalid setting: names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r} is invalid: {allowed}")


class ModelLoadError(DSparkError):
    """A model or tokenizer could not be found, read or understood."""
