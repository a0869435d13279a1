"""The errors a user can act on, and the warning record: the ground floor (imports nothing of Atelier).

Every module that refuses a setting, a file or a model raises one of these, so the CLI, the UI and the run's
events show each the same way: the message says what is wrong and what to do; ``key`` names the config field
(a dotted path such as ``data.concepts.0.path``) the user should look at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence


class ConfigError(ValueError):
    """A config problem a user can fix; ``key`` names the field (dotted path)."""

    def __init__(self, message: str, key: str = "", value: Any = None):
        super().__init__(message)
        self.key = key
        self.value = value


class ConfigErrors(ConfigError):
    """Several config problems found in one pass (validate reports them all at once): ``errors`` holds each with
    its own key; the message is theirs, one a line; ``key`` is the first one's."""

    def __init__(self, errors: Sequence[ConfigError]):
        self.errors: List[ConfigError] = list(errors)
        first = self.errors[0]
        super().__init__("\n".join(str(e) for e in self.errors), key=first.key, value=first.value)


def every_error(exc: ConfigError) -> List[ConfigError]:
    """The single problems a ConfigError carries: its ``errors`` for :class:`ConfigErrors`, else itself."""
    return list(getattr(exc, "errors", None) or [exc])


def raise_all(errors: Sequence[ConfigError]) -> None:
    """Raise what was collected: nothing for none, one error as itself, several as :class:`ConfigErrors`."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


@dataclass
class Issue:
    """A cross-field warning (or error) attached to a field, shown before launch."""
    key: str
    message: str
    level: str = "warning"


class DataError(ConfigError):
    """A dataset problem the user can fix (missing folder, no usable image, bad caption file).

    It is a :class:`ConfigError`, so the CLI and the UI show it the same way as a bad setting:
    ``key`` names the config field (``data.concepts.0.path``) the user should look at.
    """


class ModelLoadError(ConfigError):
    """The base model could not be loaded; the message says why and what to do."""


class TrainingError(RuntimeError):
    """A failure during training with a message a user can act on."""


__all__ = ["ConfigError", "ConfigErrors", "DataError", "Issue", "ModelLoadError", "TrainingError", "every_error",
           "raise_all"]
