"""Reading data files (systems, models, kernel profiles) from a name or a path.

One place says, in one line each, what is wrong with a file a user names: it does not exist, no
shipped spec has that name, or it is not valid TOML.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from topologies.common import InputError


def did_you_mean(word: str, choices) -> str:
    """" did you mean X?" (or "X or Y?") for the choices closest to a misspelled `word`, "" if none is close."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=2, cutoff=0.6)
    return f" did you mean {' or '.join(close)}?" if close else ""


def shipped(folder: Path) -> list[str]:
    """Names of the specs in `folder` (its .toml files without the suffix), sorted."""
    return sorted(p.stem for p in folder.glob("*.toml"))


def spec_text(name_or_path: str, folder: Path, what: str) -> tuple[Path, str]:
    """Resolve a shipped name (folder/<name>.toml) or a .toml path and read its text.

    what: the kind of spec for messages ("system", "model", "kernel profile").
    Raises InputError when the file is missing, unknown or not text.
    """
    path = Path(str(name_or_path))
    names = ", ".join(shipped(folder))
    if path.suffix == ".toml":
        if not path.exists():
            raise InputError(f"{what} file {path} does not exist (shipped {what}s: {names})")
    else:
        path = folder / f"{name_or_path}.toml"
        if not path.exists():
            raise InputError(f"unknown {what} {name_or_path!r}:{did_you_mean(name_or_path, shipped(folder))} "
                             f"choose one of {names} or give the path of a {what} .toml file")
    try:
        return path, path.read_text()
    except UnicodeDecodeError as e:
        raise InputError(f"malformed {what} file {path}: {e}") from None


def parse_spec(path: Path, text: str, what: str) -> dict:
    """The TOML `text` of the file at `path`, parsed; InputError when it is not valid TOML."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"malformed {what} file {path}: {e}") from None


def read_spec(name_or_path: str, folder: Path, what: str) -> tuple[Path, dict]:
    """Resolve a shipped name (folder/<name>.toml) or a .toml path and parse it (spec_text, parse_spec).
    Raises InputError when the file is missing, unknown or malformed."""
    path, text = spec_text(name_or_path, folder, what)
    return path, parse_spec(path, text, what)
