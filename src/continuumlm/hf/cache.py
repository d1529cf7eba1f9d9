"""The model's own decoding state as a transformers ``Cache`` (``ContinuumLMCache``), and the
name transformers gives the cache in a model's output (``cache`` from 5.24, ``past_key_values``
before)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..model.cache import DecodeState

# the output field that carries the cache (transformers 5.24 renamed past_key_values)
CACHE_FIELD = ("cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__
               else "past_key_values")


class ContinuumLMCache(Cache):
    """The :class:`DecodeState` of a ContinuumLM model (one cache per (block, solver stage
    evaluation) of an ODE stack, or per step or block with ``model.ode_kv``; one per layer of
    a discrete one) as a transformers ``Cache``.

    It holds no per-layer key/value tensors of transformers' kind (``layers`` is empty): each
    mixer keeps its own state (keys and values, a DeltaNet recurrent state, a continuous
    attention's value history), which is what keeps cached ODE decoding exact. Every one of
    them is batch-first, so beam search's reordering and expansion are an index on the batch
    dimension. Cropping (assisted and prompt-lookup decoding drop the drafted tokens that were
    not accepted) cuts every cache back (:meth:`DecodeState.crop`); the model makes its states
    able to cut back ``REWIND`` tokens (a DeltaNet state keeps what those need)."""

    REWIND = 256  # transformers drafts num_assistant_tokens (20 by default) at a time

    def __init__(self, state: DecodeState):
        super().__init__(layers=[])
        self.state = state

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.state.pos

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        self.state = DecodeState(self.state.batch_size, self.state.rewind)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state.reorder(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        index = torch.arange(self.state.batch_size).repeat_interleave(repeats)
        self.state.reorder(index)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state.reorder(torch.as_tensor(indices, dtype=torch.long))

    def crop(self, length: int) -> None:
        """Remove ``-length`` tokens (zero or negative, transformers from 5.24), or keep the
        first ``length`` (positive, the earlier releases' meaning)."""
        n = self.state.pos
        keep = n + length if length <= 0 else min(length, n)
        self.state.crop(max(keep, 0))
