"""Decoding: generation from a model, above it (it reads the model, the model never imports it).

One cached token: ``Decoder.stream`` (decoder.py) picks a path and runs ``token_stream``
(stream.py), which samples (sampling.py) from the logits of one extension of the model's
``DecodeState`` by the token just chosen: eager, ``model.step`` -> depth -> each field
evaluation -> ``mixer.extend(x, cache)`` (k >= 1 tokens; k > 1 verifies drafts, speculative.py);
frozen (frozen.py), the state fixed to buffers of one capacity with its position in tensors,
``model.frozen_logits(ids, state, evaluate)`` -> depth, which runs each repeating unit
(a solver step, a layer) through the evaluator (``Compiled``: torch.compile; None: eager) ->
``mixer.extend_frozen(x, cache)``. Graph replay (replay.py) records that whole frozen step
once per capacity and replays it (CUDA graphs; the CPU emulation in tests), behind one
``Recorder`` interface. Every cache can be cut back (``DecodeState.crop``): decoding n tokens,
cutting to m and decoding on equals decoding m and going on, which assisted and speculative
decoding rely on. ``LanguageModel.generate`` reaches the decoder through ``registry.DECODERS``.
At batch 1, eager, on the CPU, the model's own solve runs op by op instead, with caches of its
own (lean_draft.py for ODE blocks, lean_stack.py for a discrete stack; lean.own_step decides),
where it covers the model: the same logits, without the decoding state's and modules' dispatch.
"""

from .decoder import Decoder
from .frozen import Compiled, frozen_decoder
from .replay import EmulatedGraphRecorder, GraphRecorder, Recorder, TokenGraphs
from .sampling import check_sampling_args, filter_logits, probabilities, sample_next
from .speculative import Draft, DraftStats

__all__ = ["Decoder", "Compiled", "frozen_decoder", "GraphRecorder", "EmulatedGraphRecorder",
           "Recorder", "TokenGraphs", "check_sampling_args", "filter_logits", "probabilities",
           "sample_next", "Draft", "DraftStats"]
