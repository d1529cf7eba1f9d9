"""Registries of the pluggable parts: token mixers, ODE vector fields, ODE solvers, depths.

A registry maps a config name (``model.mixer = "deltanet"``) to the class (or factory) that
builds the part from the model config. The built-in parts register themselves with the same
decorators a user's package uses::

    import continuumlm

    @continuumlm.register_mixer("my_mixer")
    class MyMixer(torch.nn.Module):
        cache_factory = MyCache          # the type of its decoding cache
        def __init__(self, cfg): ...     # cfg: the ModelConfig
        def forward(self, x): ...        # the whole sequence (B, T, C)
        def extend(self, x, cache): ...  # k >= 1 new tokens through its cache
        def extend_frozen(self, x, cache): ...  # one token, the cache's frozen layout

(a mixer without ``extend`` takes ``forward(x, cache=None)`` for all three, as before; one
with ``cache_factory = None`` keeps no decoding cache: it trains and evaluates, generation
recomputes the context with ``use_cache=False`` / ``--no-cache``, and decoding with caches is
refused by its name.)

The built-ins live in modules that this one never imports at load time (it stays free of
torch, so the command line answers ``--help`` at once): the first lookup in a registry imports
them, then the packages of the ``continuumlm.plugins`` entry-point group, so every lookup sees
the same set of names. A user's module given with ``--plugin`` (or saved in a run's
``plugins`` list) is imported by :func:`load_plugins`.
"""

from __future__ import annotations

import difflib
import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .errors import ConfigError

ENTRY_POINT_GROUP = "continuumlm.plugins"
# modules to import as plugins in every process (set by --plugin, so that the processes a
# command starts, torchrun ranks and benchmark children, load them too); comma-separated
PLUGINS_ENV = "CONTINUUMLM_PLUGINS"


class UnknownComponent(ConfigError, KeyError):
    """A name that no registry entry has; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry(Mapping):
    """Name -> component, filled by :meth:`register`. ``key`` is the config field that selects
    from it (named in errors); ``builtins`` are the modules whose import registers the
    package's own components."""

    def __init__(self, kind: str, key: str, builtins: tuple[str, ...], public: bool = True):
        self.kind, self.key, self.builtins, self.public = kind, key, builtins, public
        self._entries: dict[str, Any] = {}
        self._loaded = False
        self._loading = False
        self._replaced: set[str] = set()

    def register(self, name: str, obj: Any = None, *, replace: bool = False):
        """``@registry.register("name")`` on a class, or ``registry.register("name", obj)``.
        A name can be taken once; ``replace=True`` swaps an entry on purpose."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a {self.kind} name must be an identifier (letters, digits, _), "
                             f"got {name!r}.")

        def add(target):
            if not self._loading:  # a plugin: the built-ins first, so that a name it takes
                self._load()       # (or replaces) is decided against them
            old = self._entries.get(name)
            if old is not None and old is not target and not replace \
                    and _describe(old) != _describe(target):  # the same class re-imported
                raise ValueError(f"the {self.kind} name {name!r} is taken by "
                                 f"{_describe(old)}; choose another name or pass "
                                 f"replace=True.")
            if old is not None and name in self._replaced and not replace:
                return target  # a built-in registering after a plugin replaced it
            if replace:
                self._replaced.add(name)
            self._entries[name] = target
            return target

        return add if obj is None else add(obj)

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True  # first: the built-in modules look names up while importing
            self._loading = True
            try:
                for module in self.builtins:
                    importlib.import_module(module)
            except BaseException:
                self._loaded = False
                raise
            finally:
                self._loading = False
            load_entry_point_plugins()

    def __getitem__(self, name: str) -> Any:
        self._load()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownComponent(self.unknown_message(name)) from None

    def component_class(self, name: str) -> type:
        """The class behind an entry (a registered factory such as a ``functools.partial`` of
        a class is unwrapped), for reading its class attributes."""
        obj = self[name]
        return getattr(obj, "func", obj)

    def unknown_message(self, name: Any) -> str:
        close = difflib.get_close_matches(str(name), list(self._entries), n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        own = (f" A {self.kind} of your own is registered with continuumlm.register_"
               f"{self.kind}(name) in a module given with --plugin." if self.public else "")
        return (f"{self.key} = {name!r} is not available{hint}; available: "
                f"{', '.join(sorted(self._entries))}.{own}")

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(self._entries)

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self._entries) or 'not loaded'})"


def _describe(obj: Any) -> str:
    target = getattr(obj, "func", obj)  # functools.partial
    extra = f"({sorted(obj.keywords.items())})" if hasattr(obj, "keywords") else ""
    return (f"{getattr(target, '__module__', '?')}."
            f"{getattr(target, '__qualname__', target)}{extra}")


MIXERS = Registry("mixer", "model.mixer", ("continuumlm.mixers",))
FIELDS = Registry("field", "model.field", ("continuumlm.model.fields",))
SOLVERS = Registry("solver", "model.ode_solver", ("continuumlm.ode",))
DEPTHS = Registry("depth", "model.depth", ("continuumlm.model.depth",), public=False)
# what LanguageModel.generate runs ("default": continuumlm.decoding.Decoder): the decoder
# sits above the model and reads it through its decoding interface, so the model names it
# here rather than importing it
DECODERS = Registry("decoder", "decoder", ("continuumlm.decoding",), public=False)
# how gradients pass through a solve (model.ode_grad): each mode with the solvers it refuses
GRADS = Registry("gradient mode", "model.ode_grad", ("continuumlm.ode.grad",), public=False)
REGISTRIES = {"mixer": MIXERS, "field": FIELDS, "solver": SOLVERS, "depth": DEPTHS}


def register_mixer(name: str, *, replace: bool = False) -> Callable:
    """Decorator: ``Mixer(cfg)`` with ``forward(x)``, ``extend(x, cache)``,
    ``extend_frozen(x, cache)`` (or ``forward(x, cache=None)`` alone), ``cache_factory`` and
    optionally ``penalty()``; selected by ``model.mixer = name``."""
    return MIXERS.register(name, replace=replace)


def register_field(name: str, *, replace: bool = False) -> Callable:
    """Decorator: ``Field(cfg)`` with ``forward(t, h, cache=None) -> dh/dt`` (see
    ``continuumlm.model.fields``); selected by ``model.field = name``."""
    return FIELDS.register(name, replace=replace)


def register_solver(name: str, *, replace: bool = False) -> Callable:
    """Decorator: ``Solver(cfg)`` with ``fixed_grid``, ``reversible``, ``evals_per_step`` and
    ``step(f, t, h, dt)`` (see ``continuumlm.ode.solvers``); selected by
    ``model.ode_solver = name``."""
    return SOLVERS.register(name, replace=replace)


# ------------------------------------------------------------------ plugins

_loaded_plugins: list[str] = []
_entry_points_loaded: bool | str | ConfigError = False


def export_plugins(modules: list[str]) -> None:
    """Name ``modules`` in $CONTINUUMLM_PLUGINS, so processes started from here load them."""
    given = [m for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
    os.environ[PLUGINS_ENV] = ",".join(dict.fromkeys([*given, *modules]))


def load_plugins(modules: list[str] | tuple[str, ...]) -> None:
    """Import each module (its import registers its components). A module that cannot be
    imported is a ConfigError that says which and why."""
    for module in modules:
        if module in _loaded_plugins:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure of a user's module is reported
            raise ConfigError(
                f"plugin {module!r} could not be imported ({type(e).__name__}: {e}); install "
                f"the package that provides it (or put it on PYTHONPATH), or drop it from "
                f"--plugin / the run's plugins list.") from None
        _loaded_plugins.append(module)


def load_entry_point_plugins() -> None:
    """Import the packages that declare a ``continuumlm.plugins`` entry point, and the modules
    named in $CONTINUUMLM_PLUGINS (once per process; a failure is raised again at every
    lookup rather than leaving a half-loaded set behind)."""
    global _entry_points_loaded
    if _entry_points_loaded is True or _entry_points_loaded == "loading":
        return  # done, or under way (a plugin being imported registers, which looks here)
    if isinstance(_entry_points_loaded, ConfigError):
        raise _entry_points_loaded
    from importlib.metadata import entry_points

    _entry_points_loaded = "loading"

    try:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()
            except Exception as e:  # noqa: BLE001
                raise ConfigError(
                    f"the installed plugin {ep.name!r} ({ep.value}, entry point group "
                    f"{ENTRY_POINT_GROUP}) failed to load ({type(e).__name__}: {e}); fix or "
                    f"uninstall its package.") from None
        load_plugins([m for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()])
    except ConfigError as e:
        _entry_points_loaded = e
        raise
    _entry_points_loaded = True
