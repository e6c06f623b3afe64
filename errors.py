"""The one exception type the project raises for bad input; the CLI prints it on one line."""
from __future__ import annotations

import difflib
from dataclasses import dataclass


class EulerError(Exception):
    """A user-facing error: `file:line: key: message`, each part present when known."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 key: str | None = None):
        self.message = message
        self.file = file
        self.line = line
        self.key = key
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = f"{self.file}:{self.line}: " if self.line else f"{self.file}: "
        key = f"{self.key}: " if self.key else ""
        return f"{where}{key}{self.message}"


@dataclass(frozen=True)
class Where:
    """A place in a user's file, for errors: file, YAML line, key path."""
    file: str
    line: int
    key: str

    def error(self, message: str) -> EulerError:
        return EulerError(message, file=self.file, line=self.line, key=self.key)


def suggest(word, options, what: str = "", cutoff: float = 0.6) -> str:
    """' (did you mean 'x'?)' for the nearest of `options` (difflib's ratio past `cutoff`);
    else, when `what` names the options ('preset'), the list of valid ones; else ''. The one
    hint every error uses."""
    options = list(options)
    close = difflib.get_close_matches(str(word), options, n=1, cutoff=cutoff)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return f" (valid {what}s: {', '.join(options)})" if what else ""
