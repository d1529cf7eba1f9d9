"""Setting a module's plain attributes on the decoding path."""

from __future__ import annotations

import torch
import torch.nn as nn


def set_plain(module: nn.Module, **values) -> None:
    """``module.name = value`` for each of ``values``, for plain Python attributes only (counts,
    lists, dicts, floats, None: never a parameter, buffer or submodule), written to the
    instance's dict. nn.Module.__setattr__ stores such values there too, after type checks that
    cost a few microseconds per call; a one-token decoding step of an ODE block sets about ten
    of them, a tenth of a one-evaluation draft's time. Under torch.compile the ordinary
    setattr, which the compiler traces."""
    if torch.compiler.is_compiling():
        for name, value in values.items():
            setattr(module, name, value)
        return
    module.__dict__.update(values)
