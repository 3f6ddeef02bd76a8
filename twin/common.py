"""What every layer of the project shares: the one error type for bad input, and atomic file writing.

InputError (also named TwinError) is bad user input: an unknown system or model, a grid that does not
divide, a model that does not fit, a malformed file. Its message says what is wrong and how to fix it;
the command lines turn it into one line on stderr and exit code 2. write_atomic writes an output so
that a failure never leaves half a file. This module imports nothing of the project: topologies, twin,
backend and calibration all use it.
"""

from __future__ import annotations

from pathlib import Path


class InputError(ValueError):
    """Bad input: the message says what is wrong and how to fix it."""


TwinError = InputError  # the name the twin and the backend use


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` via a temporary file and a rename: the old file stays whole on failure."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
