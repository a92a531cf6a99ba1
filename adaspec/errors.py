"""Errors that carry a message meant for the user (CLI prints it, the server returns it as a 400)."""


class AdaspecError(Exception):
    """Base class: the message names the problem and, where possible, what to change."""


class InvalidRequestError(AdaspecError, ValueError):
    """A request or sampling parameter that cannot be served (OpenAI 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(AdaspecError):
    """A model directory that is missing, corrupt, or of an unsupported architecture."""


class ConfigError(AdaspecError, ValueError):
    """An engine or speculative configuration that cannot work."""
