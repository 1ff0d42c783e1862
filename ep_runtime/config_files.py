"""Job configs as TOML files, as ``ep-runtime train --config FILE`` reads them; the presets are the
files in ``ep_runtime/configs/`` (``--model NAME`` reads ``configs/NAME.toml``).

Tables mirror ``config.py``'s dataclasses: ``[model]``, ``[model.moe]``, ``[model.moe.router]``,
``[model.mhc]``, ``[model.engram]``, ``[parallel]``, ``[train]``. A key left out keeps the
dataclass default; a table left out keeps the default component (``mhc`` and ``engram``: none). An
unknown key or a value of the wrong type is an error naming the key's path.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path

from .config import JobConfig

PRESET_DIR = Path(__file__).with_name("configs")


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESET_DIR.glob("*.toml"))


def preset_path(name: str) -> Path:
    return PRESET_DIR / f"{name}.toml"


def preset(name: str) -> JobConfig:
    """The preset ``name`` as its file gives it (no flags, no derived defaults)."""
    return build(JobConfig, read_toml(preset_path(name)))


def read_toml(path: str | Path) -> dict:
    """The file's tables; a missing or malformed file is a ``ValueError`` naming it."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML ({error})") from None


def build(cls: type, table: dict, path: str = ""):
    """An instance of the config dataclass ``cls`` from ``table`` (its fields by name; nested
    dataclasses from sub-tables). ``path`` names the table in errors (``model.moe``)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in table.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            raise ValueError(f"{where}: unknown key (expected one of {', '.join(names)})")
        component = _dataclass_in(hints[key])
        if component is not None:
            if not isinstance(value, dict):
                raise ValueError(f"{where}: expected a table, got {value!r}")
            kwargs[key] = build(component, value, where)
        else:
            kwargs[key] = _checked(hints[key], value, where)
    return cls(**kwargs)


def _dataclass_in(hint) -> type | None:
    """The dataclass a field holds (``MHCConfig`` of ``MHCConfig | None``), if any."""
    for option in typing.get_args(hint) or (hint,):
        if dataclasses.is_dataclass(option):
            return option
    return None


_SCALARS = {int: "an int", float: "a number", str: "a string", bool: "true or false"}


def _checked(hint, value, where: str):
    """``value`` if it has the field's type (an int is a float too; a list is a tuple), else a
    ``ValueError``; ranges are the dataclasses' to check."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return value
        if typing.get_origin(option) is tuple and isinstance(value, list):
            (item, _) = typing.get_args(option)
            if all(_is(item, v) for v in value):
                return tuple(value)
        if option in _SCALARS and _is(option, value):
            return value
    expected = " or ".join(_SCALARS.get(o, "a list") for o in options if o is not type(None))
    raise ValueError(f"{where}: expected {expected}, got {value!r}")


def _is(kind: type, value) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
