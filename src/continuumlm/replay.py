"""A CPU stand-in for CUDA-graph capture and replay, for checking that a decoding step can be
recorded once and replayed for every later token (``generate(cuda_graph=...)``), on a machine
without CUDA. It has the interface of :class:`continuumlm.model.generation.GraphRecorder`
(``warmup(fn)``, ``record(fn) -> (replay, out)``); :func:`continuumlm.testing.check_cached_decoding`
decodes through it, so a plugin's mixer is held to what a recorded graph needs.

What a CUDA graph keeps of a captured function is its device work, in order, on fixed memory:
Python runs once, at capture, and every Python value it read then is baked in; nothing runs on
the device during capture, so the memory the function writes holds its old values until the
first replay; a read of a device value on the host (``.item()``, ``bool(t)``) is an error
while capturing. This recorder does the same with aten operations on the CPU
(a ``TorchDispatchMode``):

- at capture it runs the operations that make new tensors (their results stand in for the
  capture-time allocations, and later operations are recorded against them) and records every
  operation; it does not run the ones that write into an existing tensor, so the captured
  function changes no state;
- a replay runs the record in order: an operation that writes in place is run as recorded; an
  operation that makes a new tensor is run again and its result copied into the tensor it
  made at capture; a view is not run again (it already aliases the memory it views; an
  operation that may return a view, such as ``to`` or ``reshape``, counts as one only where
  it did);
- ``aten._local_scalar_dense`` (every ``.item()``, ``bool(t)``, ``int(t)``) and any operation
  that returns a Python number (``torch.equal``) raise while capturing: host reads of device
  values.

A function that decodes correctly through this replay reads nothing from Python that changes
between tokens, and leaves its work to the tensors a replay refreshes. Written here: torch
has no CPU emulation of stream capture. Operations that bypass aten (inductor's compiled CPU
kernels) are invisible to it, so it checks eager steps; compiled ones are checked on CUDA.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# what an operation of tensors returns to the host when it reads their values (``torch.equal``'s
# bool; a dtype is an int in a schema too, but promote_types takes no tensor)
_HOST_VALUES = {"bool", "int", "float", "Scalar", "complex"}


class CaptureError(RuntimeError):
    """What CUDA raises for a host synchronization inside stream capture."""


def _aliases(func, args, kwargs, out) -> bool:
    """Whether ``func`` returned views of its inputs' memory. A schema's alias annotation
    says only that it may (``to``, ``reshape`` and ``contiguous`` return a view or a new
    tensor as the case may be), so the memory is compared."""
    if not any(r.alias_info is not None and not r.alias_info.is_write
               for r in func._schema.returns):
        return False
    inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor)}
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return all(t.untyped_storage().data_ptr() in inputs for t in outs)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes into (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


class _Capture(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default or (
                any(str(r.type) in _HOST_VALUES for r in func._schema.returns)
                and any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0])):
            raise CaptureError(f"a tensor value was read on the host while capturing "
                               f"({func}): operation not permitted when stream is capturing")
        written = _written(func, args, kwargs)
        if written:
            # not run: the memory keeps its old values until a replay; an in-place or out=
            # operation returns what it wrote
            if any(r.alias_info is None for r in func._schema.returns):
                raise NotImplementedError(f"{func} both writes into an argument and makes a "
                                          f"new tensor; this recorder does not emulate it")
            self.ops.append(("write", func, args, kwargs, None))
            return written[0] if len(func._schema.returns) == 1 else tuple(written)
        out = func(*args, **kwargs)
        self.ops.append(("view" if _aliases(func, args, kwargs, out) else "new", func, args,
                         kwargs, out))
        return out


class EmulatedGraph:
    """One capture and its replays, as a ``torch.cuda.CUDAGraph`` is: ``with
    graph.capture(): ...`` records what runs inside (under the rules above), and
    ``replay()`` runs the record."""

    def __init__(self) -> None:
        self.ops: list | None = None

    @contextlib.contextmanager
    def capture(self):
        capture = _Capture()
        with capture:
            yield
        self.ops = capture.ops

    def replay(self) -> None:
        for kind, func, args, kwargs, made in self.ops:
            if kind == "view":
                continue
            result = func(*args, **kwargs)
            if kind == "new":
                for dst, src in zip(tree_flatten(made)[0], tree_flatten(result)[0]):
                    if isinstance(dst, torch.Tensor):
                        dst.copy_(src)


class EmulatedGraphRecorder:
    """``GraphRecorder`` on the CPU: see the module's docstring. ``records`` and ``replays``
    count what it did."""

    def __init__(self) -> None:
        self.records = 0
        self.replays = 0
        self.warmups = 0

    def warmup(self, fn):
        self.warmups += 1
        return fn()

    def record(self, fn):
        graph = EmulatedGraph()
        with graph.capture():
            out = fn()
        self.records += 1

        def replay() -> None:
            self.replays += 1
            graph.replay()

        return replay, out
