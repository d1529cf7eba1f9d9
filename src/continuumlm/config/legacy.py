"""The names earlier versions gave settings that now live in tables, and the one splitter that
moves them there: used by every section of a config, a saved run or checkpoint, and ``--set``
(through :func:`continuumlm.config.loading.canonical_key`).

A config written by hand (not a saved run's) that uses an old name gets one line naming the
new spellings (``checks.note_old_spelling``); both spellings of one setting are refused."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError
from .checks import _in, _origin, _strict, note_old_spelling

# section -> {old flat key: (table, key in the table)}
OLD_NAMES: dict[str, dict[str, tuple[str, str]]] = {
    # the built-in components' settings, flat in [model] in version 0.1; now [model.NAME]
    "model": {
        "deltanet_short_conv": ("deltanet", "short_conv"),
        "cat_basis": ("continuous", "basis"),
        "cat_n_freq": ("continuous", "n_freq"),
        "cat_n_quad": ("continuous", "n_quad"),
        "cat_sob_lambda": ("continuous", "sob_lambda"),
        "cat_length": ("continuous", "length"),
        "cat_quadrature": ("continuous", "quadrature"),
        "cat_panel": ("continuous", "panel"),
        "cat_mode": ("continuous", "mode"),
        "cat_kernel": ("continuous", "kernel"),
    },
    # elastic depth, distillation and the solve regularizers, flat in [train] before their
    # tables [train.elastic], [train.distill] and [train.regularize]
    "train": {
        "ode_steps_choices": ("elastic", "steps"),
        "ode_solver_choices": ("elastic", "solvers"),
        "ode_max_nfe": ("elastic", "max_nfe"),
        "elastic_from": ("elastic", "start"),
        "consistency_weight": ("elastic", "consistency_weight"),
        "consistency_max_nfe": ("elastic", "consistency_max_nfe"),
        "consistency_every": ("elastic", "consistency_every"),
        "distill_from": ("distill", "teacher"),
        "distill_weight": ("distill", "weight"),
        "kinetic_weight": ("regularize", "kinetic_weight"),
        "jacobian_weight": ("regularize", "jacobian_weight"),
        "step_readout_weight": ("regularize", "step_readout_weight"),
        "steer": ("regularize", "steer"),
    },
}


def split_tables(section: str, d: dict[str, Any], source: str | None,
                 overridden: dict[str, str] | None, nest: str | None = None) -> dict[str, Any]:
    """[section] as read (TOML, JSON or --set) with its tables gathered and the old flat names
    moved into them. ``nest``: the field that holds the section's tables as one dict of dicts
    (ModelConfig.components, where every [model.NAME] table goes); None: each table is a key
    of the section ([train.elastic], ...)."""
    names = OLD_NAMES.get(section, {})
    old_tables = {table for table, _ in names.values()}
    out: dict[str, Any] = {}
    tables: dict[str, Any] = {}
    for key, value in d.items():
        if key in names:
            continue
        if isinstance(value, dict) and key != nest and (nest is not None or key in old_tables):
            tables[key] = dict(value)  # copied: old names are added to it below
        else:
            out[key] = value
    moved = []
    for old in (k for k in d if k in names):
        name, leaf = names[old]
        table = out[name] if name in out else tables.setdefault(name, {})
        if dataclasses.is_dataclass(table):  # the table built already, an old key beside it
            raise ConfigError(f"{section}.{old} is given beside a built [{section}.{name}] "
                              f"table{_in(source)}; set {leaf} in the table instead.")
        if not isinstance(table, dict):
            continue  # refused when the table is built ("must be a table")
        if leaf in table:
            where = _origin(f"{section}.{old}", source, overridden) or _in(source)
            raise ConfigError(f"{section}.{old} and {section}.{name}.{leaf} both set {leaf}"
                              f"{where}; keep [{section}.{name}] {leaf} = ... ({section}.{old} "
                              f"is the older spelling).")
        table[leaf] = d[old]
        moved.append((f"{section}.{old}", f"{section}.{name}.{leaf}"))
    if moved and _strict():
        note_old_spelling(moved, source, overridden)
    if nest is None:
        out.update(tables)
    elif tables:
        given = out.get(nest, {})
        out[nest] = {**(given if isinstance(given, dict) else {}), **tables}
    return out
