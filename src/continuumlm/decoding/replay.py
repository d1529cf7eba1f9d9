"""Graph replay: a token step's device work recorded once and replayed for every later token.

Recorders share one interface (:class:`Recorder`): :class:`GraphRecorder` records CUDA graphs,
:class:`EmulatedGraphRecorder` emulates their capture on the CPU (for tests, and for a
plugin's mixer held to what a recorded graph needs). :class:`TokenGraphs` replays a frozen
state's token step through either.

The emulation: a CPU stand-in for CUDA-graph capture and replay, for checking that a
decoding step can be recorded once and replayed for every later token
(``generate(cuda_graph=...)``) on a machine without CUDA. It is a :class:`Recorder` as
:class:`GraphRecorder` is; :func:`continuumlm.testing.check_cached_decoding` decodes through
it, so a plugin's mixer is held to what a recorded graph needs.

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
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..errors import first_line
from ..model.cache import DecodeState
from ..nn import tensor_state

log = logging.getLogger("continuumlm")

T = TypeVar("T")


class Recorder(Protocol):
    """What :class:`TokenGraphs` records and replays through. ``warmup(fn)`` runs ``fn`` for
    real (as capture needs before it: lazy initialization, compilation); ``record(fn)``
    captures ``fn`` without running it and returns ``(replay, out)``: each ``replay()`` runs
    the recorded work and leaves its results in ``out``'s memory; or None when the capture
    was refused, after which ``refused`` says why (reported once, by the recorder) and every
    later ``record`` returns None. ``warmups``, ``records`` and ``replays`` count what it
    did."""

    warmups: int
    records: int
    replays: int
    refused: str | None
    warmups_needed: int  # real runs of a step before it is recorded

    def warmup(self, fn: Callable[[], T]) -> T: ...

    def record(self, fn: Callable[[], T]) -> tuple[Callable[[], None], T] | None: ...


class GraphRecorder:
    """Records a function's device work once and replays it (CUDA graphs): ``warmup(fn)``
    runs ``fn`` for real on a side stream, as capture needs before it (lazy library
    initialization, compilation); ``record(fn) -> (replay, out)`` captures ``fn`` without
    running it, and each ``replay()`` then runs its recorded work, leaving the results in
    ``out``'s memory (the :class:`Recorder` interface). Everything runs on ``device`` (the
    prompt's), whichever CUDA device is current.

    A refused capture is recorded here (``refused``), warned of once, and no capture is tried
    again by this recorder: a failed capture can leave CUDA's caching allocator believing the
    capture still runs (releases without pytorch#180395: the ``empty_cache`` that every
    capture starts with then fails an internal assert) and its memory pool reserved. Another
    recorder that tries again and meets that assert is refused the same way."""

    # real runs before a capture, on the capture stream, as torch's make_graphed_callables
    # does: lazy initialization, autotuning and cuBLAS's per-stream workspace settle first
    warmups_needed = 3

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.warmups = self.records = self.replays = 0
        self.refused: str | None = None
        self._stream = None  # the capture stream, made on ``device`` at first use

    def _capture_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def warmup(self, fn):
        self.warmups += 1
        with torch.cuda.device(self.device):
            side, now = self._capture_stream(), torch.cuda.current_stream()
            side.wait_stream(now)
            with torch.cuda.stream(side):
                out = fn()
            now.wait_stream(side)
            # what it made on the capture stream is used on the caller's: the allocator must
            # not hand that memory out again before the caller's stream is done with it
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(now)
        return out

    def record(self, fn):
        """(replay, out); or None, after a warning, when CUDA refuses to record ``fn`` (nothing
        of it ran: the caller runs the step itself and records no more). After one refusal
        this recorder tries no more: None at once."""
        if self.refused is not None:
            return None
        with torch.cuda.device(self.device):
            stream = self._capture_stream()
            before = torch.cuda.current_stream()
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: a CUDA call another thread makes meanwhile (a data loader's
                # pinned-memory copies) does not spoil this capture
                with torch.cuda.graph(graph, stream=stream,
                                      capture_error_mode="thread_local"):
                    out = fn()
            # any exception: CUDA's (torch.AcceleratorError among them), and a compiler's or
            # Triton's raised inside the capture, which leave it as invalid
            except Exception as e:
                # an error inside the capture makes ending it fail too, and that error, which
                # only says the capture is invalid, replaces the first: name the first
                cause = e.__context__ if isinstance(e.__context__, Exception) else e
                self.refused = f"{type(cause).__name__}: {first_line(cause)}"
                log.warning("generate(cuda_graph): CUDA could not record the token step as a "
                            "graph (%s); decoding without graph replay, and this decoder "
                            "records no more graphs.", self.refused)
                return None
            finally:
                # torch.cuda.graph leaves its capture stream current when ending a capture
                # fails (it ends the capture before it restores the stream)
                torch.cuda.set_stream(before)
        self.records += 1

        def replay() -> None:
            self.replays += 1
            graph.replay()
        return replay, out


class TokenGraphs:
    """A frozen state's token step ``run(ids, state)`` replayed from a recorded graph.

    A frozen state keeps every buffer at a fixed address and its position in tensors, and
    the step reads no Python value that changes between tokens (the property the compiled
    unit already needs), so the device work of one token, recorded once, is the work of
    every later token at that capacity. The first tokens at a capacity run for real (the
    recorder's ``warmups_needed`` warm-ups: 3 for CUDA, 1 for the emulation), the next is
    recorded and replayed, the rest replayed: on CUDA, one
    graph launch per token instead of a kernel launch per operation (hundreds per field
    evaluation's worth of Python and dispatch). A refreeze (new buffers), another batch shape,
    or a weight changed or replaced between tokens (its address or version counter) records
    again. What the step returns is copied out of the graph's memory, which the next replay
    overwrites."""

    def __init__(self, model, recorder: GraphRecorder, run) -> None:
        self.model, self.recorder, self.run = model, recorder, run
        self.recorded = None  # (key, replay, logits in the graph's memory, ids buffer)
        self.warmed = (None, 0)  # the key last run as a warm-up, and how many times
        self.failed = False   # the recorder refused (and warned): run the step directly

    def _key(self, ids: torch.Tensor, st: DecodeState, tensors: list[torch.Tensor]):
        # the StaticStep itself (compared by identity): a refreeze makes a new one. A buffer
        # made under inference mode (a RoPE table grown by a long prompt) has no version
        # counter; the model replaces such tables rather than changing them, which the
        # address shows (weights of that kind are refused in _graph_recorder). A graph reads
        # by address, dtype and shape, which the key holds too
        return (st.static, tuple(ids.shape), ids.dtype, tuple(map(tensor_state, tensors)))

    def __call__(self, ids: torch.Tensor, st: DecodeState) -> torch.Tensor:
        if self.failed or getattr(self.model.depth, "exit", None) is not None or \
                getattr(self.model.depth, "ladder", None) is not None:
            return self.run(ids, st)  # refused; or per-token exit (decided on the host)
        tensors, training = _walk(self.model)
        if training:  # a module switched to training between tokens: dropout draws masks
            return self.run(ids, st)
        key = self._key(ids, st, tensors)
        if self.recorded is None or self.recorded[0] != key:
            self.recorded = None  # the old graph's memory goes before a new one is recorded
            runs = self.warmed[1] if self.warmed[0] == key else 0
            if runs < getattr(self.recorder, "warmups_needed", 1):
                self.warmed = (key, runs + 1)
                return self.recorder.warmup(lambda: self.run(ids, st))
            buffer = ids.clone()
            recorded = self.recorder.record(lambda: self.run(buffer, st))
            if recorded is None:
                self.failed = True
                return self.run(ids, st)
            self.recorded = (key, *recorded, buffer)
        _, replay, out, buffer = self.recorded
        buffer.copy_(ids)
        replay()
        return out.clone()


def _walk(module: torch.nn.Module) -> tuple[list[torch.Tensor], bool]:
    """Every parameter and buffer of ``module`` and its submodules (what ``parameters()`` and
    ``buffers()`` give, in a fixed order; a tensor two modules share comes twice), and whether
    any of the modules is in training mode: read from the modules' own tables, faster than
    those generators (which build names), since this runs for every replayed token."""
    out, seen, todo, training = [], set(), [module], False
    while todo:
        m = todo.pop()
        if id(m) in seen:  # a module registered twice, or a cycle
            continue
        seen.add(id(m))
        training = training or m.training
        out += [t for t in m._parameters.values() if t is not None]
        out += [t for t in m._buffers.values() if t is not None]
        todo += [c for c in reversed(m._modules.values()) if c is not None]
    return out, training



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
    """:class:`GraphRecorder` on the CPU (the :class:`Recorder` interface): see the module's
    docstring. A capture that reads a device value on the host raises
    :class:`CaptureError` (a test wants to see it), rather than being refused."""

    warmups_needed = 1

    def __init__(self) -> None:
        self.records = 0
        self.replays = 0
        self.warmups = 0
        self.refused: str | None = None

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
