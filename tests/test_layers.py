"""Imports run one way: each part of the package imports only from its own layer or below.

Read from the source (every import statement, at module level or inside a function), so an
upward import fails here even when no import order happens to expose it as a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import continuumlm

ROOT = Path(continuumlm.__file__).parent
# bottom to top; a part may import from its own layer and the layers below it
LAYERS = [
    {"errors"},
    {"registry", "threads", "atomic"},    # the component registries, the thread policy (no torch import)
    {"config"},
    {"nn", "data"},             # small modules; corpora and tokenizers
    {"ode"},                    # ODE numerics: solvers, gradient modes (nothing of attention)
    {"mixers"},                 # token mixers and their caches
    {"model"},                  # fields, depth, the language model, its decoding state
    {"decoding"},               # generation: sampling, token streams, frozen steps, replay
    {"runs"},                   # a run on disk: its folder and checkpoints
    {"eval"},
    {"train"},
    {"replay"},                 # the CPU emulation's old import path (decoding.replay)
    {"serve"},                  # the HTTP server: batching engine, request checks, the app
    {"testing", "cli", "__init__", "__main__", "hf"},  # entry points, adapters
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}


def _part(module: str) -> str:
    """'continuumlm.mixers.softmax' -> 'mixers'; the package itself -> '__init__'."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def _imports(path: Path, rel: Path | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every continuumlm import in the file; ``rel``: its path
    inside the package (default: where it lies)."""
    rel = (rel or path.relative_to(ROOT)).with_suffix("")
    package = ["continuumlm", *rel.parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == "continuumlm"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if not node.module:  # from . import x: x is a module of that package
                    found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
                    continue
                found.append((node.lineno, target))
            elif node.module and node.module.split(".")[0] == "continuumlm":
                found.append((node.lineno, node.module))
    return found


def test_every_import_points_down_or_sideways():
    modules = sorted(ROOT.rglob("*.py"))
    assert len(modules) > 30
    wrong = []
    for path in modules:
        rel = path.relative_to(ROOT).with_suffix("")
        me = _part("continuumlm." + ".".join(rel.parts))
        assert me in RANK, f"{path}: add its part {me!r} to LAYERS"
        for line, target in _imports(path):
            there = _part(target)
            if RANK[there] > RANK[me]:
                wrong.append(f"{rel}.py:{line} ({me}) imports {target} ({there})")
    assert not wrong, "imports that point up a layer:\n" + "\n".join(wrong)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker itself: a relative import from the mixers up into the model is found."""
    imports = {t for _, t in _imports(ROOT / "mixers" / "softmax.py")}
    assert {"continuumlm.mixers.cache", "continuumlm.nn"} <= imports
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n\ndef f():\n    from ..model.cache import DecodeState\n"
                     "    from . import cache\n")
    targets = [t for _, t in _imports(probe, Path("mixers/probe.py"))]
    assert targets == ["continuumlm.model.cache", "continuumlm.mixers.cache"]
    assert RANK[_part(targets[0])] > RANK["mixers"]


# A registry lookup (``MIXERS[name]``, ``name in SOLVERS``, ...) loads and calls the modules that
# fill the registry (continuumlm/registry.py: each registry's built-ins): a dependency no import
# statement shows. These are the parts each registry's built-ins live in.
REGISTRY_PARTS = {"MIXERS": "mixers", "FIELDS": "model", "SOLVERS": "ode", "DEPTHS": "model",
                  "GRADS": "ode", "DECODERS": "decoding"}
# The upward dependencies through registries, each declared with its reason; any other is an
# upward import in disguise and fails.
LATE_BOUND = {
    ("registry", "mixers"): "the registries themselves name the modules that fill them",
    ("registry", "model"): "(the same)",
    ("registry", "ode"): "(the same)",
    ("registry", "decoding"): "(the same)",
    ("config", "mixers"): "a config's names are checked against the registered components "
                          "(plugins included), which is what makes them components",
    ("config", "model"): "(fields and depths, the same)",
    ("config", "ode"): "(solvers and gradient modes, the same)",
    ("model", "decoding"): "LanguageModel.generate / generate_stream, a convenience for users: "
                           "the model names the decoder (DECODERS['default']), the decoder "
                           "reads the model through its decoding interface only, and every "
                           "other caller uses continuumlm.decoding directly",
}


def _registry_lookups(path: Path) -> set[str]:
    """The registries a file reads (names imported from continuumlm.registry and used)."""
    tree = ast.parse(path.read_text())
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[-1] == "registry" for a in node.names}
    if path.name == "registry.py" and path.parent == ROOT:
        imported |= set(REGISTRY_PARTS)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    return imported & used & set(REGISTRY_PARTS)


def test_registry_lookups_point_down_or_are_declared():
    """The layering sees registry lookups as the imports they are: an upward one is either
    declared in LATE_BOUND, with its reason, or a failure; and every declared one is used."""
    seen, wrong = set(), []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        me = _part("continuumlm." + ".".join(rel.parts))
        for name in _registry_lookups(path):
            there = REGISTRY_PARTS[name]
            if RANK[there] > RANK[me]:
                seen.add((me, there))
                if (me, there) not in LATE_BOUND:
                    wrong.append(f"{rel}.py ({me}) reads {name}, filled by {there}")
    assert not wrong, "registry lookups that point up a layer, undeclared:\n" + "\n".join(wrong)
    assert set(LATE_BOUND) == seen, f"declared but no longer used: {set(LATE_BOUND) - seen}"
