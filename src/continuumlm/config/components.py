"""The settings components own: each registered mixer, field or solver with a ``Config``
dataclass has a [model.NAME] table; the flat names of version 0.1 are mapped onto them."""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any

from ..errors import ConfigError
from ..registry import FIELDS, MIXERS, SOLVERS
from .checks import _strict, _suggest, _validate
from .legacy import OLD_NAMES

# the plain [model] keys (filled in by sections.py): a component table may not shadow them
MODEL_KEYS: set[str] = set()


# the settings of the built-in components as version 0.1 spelled them, flat in [model]
LEGACY_KEYS = OLD_NAMES["model"]


def _configurable() -> dict[str, type]:
    """Registered components that declare a ``Config``, by name (mixers first, then fields,
    then solvers: a name taken in two registries means the first)."""
    found: dict[str, type] = {}
    reserved = MODEL_KEYS | set(LEGACY_KEYS)
    for registry in (MIXERS, FIELDS, SOLVERS):
        for name in registry:
            cls = registry.component_class(name)
            if not dataclasses.is_dataclass(getattr(cls, "Config", None)):
                continue
            if name in reserved or name in found:
                what = ("a [model] key" if name in reserved else
                        f"another component with settings ({found[name].__qualname__})")
                raise ConfigError(
                    f"the {registry.kind} {name!r} ({cls.__module__}.{cls.__qualname__}) has "
                    f"settings, whose table [model.{name}] would clash with {what}; register "
                    f"it under another name.")
            found[name] = cls
    return found


def model_settings(d: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields and component tables of a ``config.json`` that also holds other
    keys (the transformers adapter's ``model_type``, ``architectures``, ...). The plugins the
    settings name are loaded first, so that their components' tables are recognized."""
    from ..registry import load_plugins

    plugins = d.get("plugins")
    if isinstance(plugins, list) and all(isinstance(p, str) for p in plugins):
        load_plugins(plugins)
    comps = _configurable()
    return {k: v for k, v in d.items()
            if k in MODEL_KEYS or k in LEGACY_KEYS or (isinstance(v, dict) and k in comps)}


def _component_class(name: str) -> type | None:
    return _configurable().get(name)


def _saved_defaults(cls) -> dict[str, Any]:
    """A component Config's ``saved_defaults``: for settings whose default changed, the value a
    run saved before the setting existed had (every run saved since records the setting)."""
    return dict(getattr(cls.Config, "saved_defaults", None) or {})


def _defaults(cls) -> list:
    """The Configs a component has when nothing is set (read back from a saved run, also the
    one with its saved defaults)."""
    return [cls.Config()] + ([] if _strict() else [cls.Config(**_saved_defaults(cls))])


def _build_components(cfg) -> dict[str, Any]:
    """Each [model.NAME] table as its component's Config, checked; plus the defaults of the
    selected mixer, field and solver when they have settings and none were given."""
    configurable = _configurable()
    given = cfg.components
    if not isinstance(given, dict):
        raise ConfigError(f"model.components must be a table of component settings, got "
                          f"{type(given).__name__}.")
    built = {}
    for name, value in given.items():
        cls = configurable.get(name)
        if cls is None:
            plain = MODEL_KEYS - {"components"}
            raise ConfigError(
                f"[model.{name}] is not the table of a component with settings"
                f"{_suggest(name, [*configurable, *plain])}; tables here: "
                f"{', '.join(f'[model.{n}]' for n in sorted(configurable)) or 'none'}"
                + (f" (model.{name} is a plain key: write {name} = ... under [model])"
                   if name in plain else "") + ".")
        if isinstance(value, cls.Config):
            value = dataclasses.asdict(value)
        if not isinstance(value, dict):
            raise ConfigError(f"[model.{name}] must be a table of key = value pairs, got "
                              f"{type(value).__name__} {value!r}.")
        known = {f.name for f in fields(cls.Config)}
        for key in value:
            if key not in known:
                raise ConfigError(f"unknown key model.{name}.{key}{_suggest(key, known)}; "
                                  f"valid keys of [model.{name}] are: "
                                  f"{', '.join(sorted(known))}.")
        if not _strict():  # a saved run: keys it lacks take what it did before they existed
            value = {**_saved_defaults(cls), **value}
        obj = cls.Config(**value)
        _validate(obj, f"model.{name}")
        if callable(getattr(obj, "validate", None)):  # checks across a component's settings
            obj.validate()
        built[name] = obj
    selected = (cfg.mixer, cfg.field, cfg.ode_solver)
    for name in selected:
        # no table at all: today's defaults, saved or not (every saved run wrote the table of
        # its selected components, or the flat 0.1 names that map to one; a fresh Hugging Face
        # config, read like a saved one, must not get an earlier version's defaults)
        if name in configurable and name not in built:
            built[name] = configurable[name].Config()
    # the defaults of a component that is not selected say nothing (0.1 checkpoints hold every
    # flat setting whatever the mixer): left out, so equal configs compare equal
    return {name: c for name, c in built.items()
            if name in selected or c not in _defaults(configurable[name])}
