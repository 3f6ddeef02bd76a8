"""Writing a profile's TOML text: a number, a `{ value = ..., source = "..." }` entry, a quoted string."""

from __future__ import annotations


def number_text(v: float) -> str:
    return f"{v:.6g}" if not float(v).is_integer() or abs(v) >= 1e15 else f"{v:.6g}"


def entry_text(value: float, source: str) -> str:
    return f'{{ value = {number_text(value)}, source = "{source}" }}'


def quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
