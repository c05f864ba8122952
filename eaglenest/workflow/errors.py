"""The one error type for bad input or configuration."""


class InputError(ValueError):
    """Bad input or configuration: the message says where (file, line, field) and what."""
