"""TOML files and ``--set`` overrides in, TOML out."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import tomllib

from ..errors import ConfigError
from .checks import _origin
from .legacy import OLD_NAMES as LEGACY
from .sections import RunConfig


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None, where: str | None = None,
                plugins: list[str] | None = None) -> RunConfig:
    """Read a TOML file with [model], [data] and [train] sections (or start from ``base``, a
    dict of sections), then apply ``section.key=value`` overrides (values parsed as TOML, bare
    words as strings). ``plugins``: modules added to ``model.plugins`` (``--plugin``)."""
    raw: dict[str, Any] = {k: dict(v) for k, v in (base or {}).items()}
    if path is not None:
        path = Path(path)
        where = str(path)
        if path.is_dir():
            raise ConfigError(f"config {path} is a folder, not a TOML file; pass a file such as "
                              f"configs/shakespeare_char/demo.toml (to continue a run in a "
                              f"folder, use --out FOLDER --resume).")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass an existing TOML file, "
                              f"e.g. configs/shakespeare_char/demo.toml.")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a BOM is harmless
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid TOML: {e}.") from None
    overridden: dict[str, str] = {}
    for item in overrides or []:
        key, value = parse_override(item)
        section, _, name = key.partition(".")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"--set {item}: [{section}] is not a table.")
        # an override replaces the file's value under either spelling (the legacy keys of
        # [model] and [train]: model.cat_basis or model.continuous.basis, ...)
        legacy = LEGACY.get(section, {})
        canonical = legacy.get(name)
        if canonical or (legacy and name.count(".") == 1):
            table, leaf = canonical or tuple(name.split("."))
            sub = raw[section].get(table)
            if isinstance(sub, dict):
                sub.pop(leaf, None)
            for old, spot in legacy.items():
                if spot == (table, leaf):
                    raw[section].pop(old, None)
        table, *inner = name.split(".")
        if inner:  # model.deltanet.short_conv=4: the [model.deltanet] table
            sub = raw[section].setdefault(table, {})
            if not isinstance(sub, dict) or len(inner) > 1:
                raise ConfigError(f"--set {item}: {section}.{table} is not a table of "
                                  f"settings; a table's settings are set as "
                                  f"{section}.TABLE.KEY=VALUE (model.deltanet.short_conv=4, "
                                  f"train.elastic.steps=[1, 2]).")
            sub[inner[0]] = value
        else:
            raw[section][name] = value
        overridden[key] = item
        if canonical:  # errors name the new spelling
            overridden[f"{section}.{canonical[0]}.{canonical[1]}"] = item
    if plugins:
        model = raw.setdefault("model", {})
        if isinstance(model, dict):
            given = model.get("plugins", [])
            if isinstance(given, list):  # anything else is refused by the type check
                model["plugins"] = list(dict.fromkeys([*given, *plugins]))
    cfg = RunConfig.from_dict(raw, where, overridden)
    try:
        cfg.check()
    except ConfigError as e:
        raise ConfigError(f"{e}{_origin(str(e), where, overridden)}") from None
    return cfg


def canonical_key(key: str) -> str:
    """A dotted key under its current spelling (``train.ode_steps_choices`` ->
    ``train.elastic.steps``, ``model.cat_basis`` -> ``model.continuous.basis``); any other key
    as given. For readers of records that kept the spelling of their day."""
    section, _, name = key.partition(".")
    spot = LEGACY.get(section, {}).get(name)
    return f"{section}.{spot[0]}.{spot[1]}" if spot else key


def parse_override(item: str) -> tuple[str, Any]:
    section, _, name = item.split("=", 1)[0].strip().partition(".")
    if "=" not in item or not section or not name:
        raise ConfigError(f"--set {item!r} must look like section.key=value, e.g. "
                          f"--set train.max_steps=100 or --set model.mixer=softmax.")
    key, text = item.split("=", 1)
    key, text = key.strip(), text.strip()
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as `softmax` is a string
    return key, value


def dump_toml(cfg: RunConfig) -> str:
    """Write a RunConfig as TOML (None values are left out: they mean "default")."""
    lines: list[str] = []

    def table(name: str, values: dict) -> None:
        lines.append(f"[{name}]")
        for k, v in values.items():
            if v is not None and not isinstance(v, dict):
                lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
        for k, v in values.items():  # [model.NAME] component tables after the plain keys
            if isinstance(v, dict):
                table(f"{name}.{k}", v)

    for section, values in cfg.to_dict().items():
        table(section, values)
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)
