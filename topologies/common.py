"""What every layer of the project shares: the one error type for bad input, and atomic file writing.

InputError (also named TwinError) is bad user input: an unknown system or model, a grid that does not
divide, a model that does not fit, a malformed file. Its message says what is wrong and how to fix it;
the command lines turn it into one line on stderr and exit code 2. write_atomic writes an output so
that a failure never leaves half a file nor its temporary file, and names the path (`naming` does that
for any write; `os_error_line` says an OSError in one line, a full disk as such); check_output checks
(and creates the folder of) an output path before any work starts; finite_json writes standard JSON
(never NaN or Infinity), the one way the project writes JSON. This module imports nothing of the
project: topologies, twin, backend and calibration all use it.
"""

from __future__ import annotations

import errno
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path


class InputError(ValueError):
    """Bad input: the message says what is wrong and how to fix it."""


TwinError = InputError  # the name the twin and the backend use


def write_atomic(path: str | Path, text: str | bytes) -> None:
    """Write `text` to `path` via a temporary file and a rename: the old file stays whole on failure,
    the temporary file is removed, and the OSError raised names `path` (a full disk included)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with naming(path):
            if isinstance(text, bytes):
                tmp.write_bytes(text)
            else:
                tmp.write_text(text)
            tmp.replace(path)
    except BaseException:
        remove_quietly(tmp)
        raise


def remove_quietly(path: str | Path) -> None:
    """Remove a file if it is there (a temporary file after a failure); never raises."""
    try:
        os.unlink(path)
    except OSError:
        pass


@contextmanager
def naming(path: str | Path):
    """Inside it an OSError that names no file (a write or close on a full disk) is raised again
    naming `path`, so that the line the user reads says which file could not be written."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise type(e)(e.errno, e.strerror, str(path)) from None
        raise


def check_output(path: str | Path, flag: str, folder: bool = False) -> Path:
    """Make sure an output path can be written before any work starts (raises InputError).

    The parent folder is created when missing; `folder`: the output is itself a folder (created).
    """
    text = str(path)
    if not text.strip():
        raise InputError(f"{flag} needs a path, got an empty one")
    p = Path(text)
    try:
        if folder:
            if p.exists() and not p.is_dir():
                raise InputError(f"{flag} {p}: exists and is not a folder")
            p.mkdir(parents=True, exist_ok=True)
            target = p
        else:
            if p.is_dir():
                raise InputError(f"{flag} {p}: is a folder; give a file name")
            p.parent.mkdir(parents=True, exist_ok=True)
            target = p.parent
    except (FileExistsError, NotADirectoryError):
        raise InputError(f"{flag} {p}: a part of the path is a file, not a folder") from None
    except OSError as e:
        raise InputError(f"{flag} {p}: cannot create it ({e.strerror})") from None
    if not os.access(target, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {p}: {target} is not writable")
    return p


def finite_json(obj, **kwargs) -> str:
    """json.dumps that writes standard JSON: a NaN or infinite float (which no valid input produces,
    but a bug might) becomes null instead of the non-standard NaN/Infinity."""
    try:  # the common case at json.dumps' speed (a trace writes millions of events through here)
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def cpu_model() -> str:
    """This machine's CPU model as /proc/cpuinfo names it, "" where it does not."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def os_error_line(e: OSError) -> str:
    """An OSError as one line naming the file: `<path>: No space left on device (the disk is full)`."""
    what = e.strerror or str(e)
    if e.errno == errno.ENOSPC:
        what += " (the disk is full: free space there or choose another folder)"
    elif e.errno == errno.EDQUOT:
        what += " (over the disk quota)"
    if e.filename is None:
        return what
    return f"{e.filename}: {what}" + (f" (renaming to {e.filename2})" if e.filename2 else "")
