"""``ContinuumLMForCausalLM``: a ``LanguageModel`` behind transformers' ``PreTrainedModel`` and
``GenerationMixin``, and ``ContinuumLMCache``, the model's own decoding state as a ``Cache``."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..errors import CheckpointError
from ..model.cache import DecodeState
from ..model.lm import LanguageModel, load_weights
from .configuration import ContinuumLMConfig


class ContinuumLMCache(Cache):
    """The :class:`DecodeState` of a ContinuumLM model (one cache per (block, solver stage
    evaluation) of an ODE stack, one per layer of a discrete one) as a transformers ``Cache``.

    It holds no per-layer key/value tensors of transformers' kind (``layers`` is empty): each
    mixer keeps its own state (keys and values, a DeltaNet recurrent state, a continuous
    attention's value history), which is what keeps cached ODE decoding exact. Beam search and
    cache cropping need to rewind or reorder those states and are refused."""

    def __init__(self, state: DecodeState):
        super().__init__(layers=[])
        self.state = state

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.state.pos

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        self.state = DecodeState(self.state.batch_size)

    def _refuse(self, what: str):
        raise NotImplementedError(
            f"{what} is not supported by ContinuumLMCache: the per-mixer decoding states "
            f"(recurrent states, value histories) cannot be reordered or rewound. Use greedy "
            f"search or sampling (num_beams=1), without assisted decoding.")

    def reorder_cache(self, beam_idx):
        self._refuse("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse("cropping the cache (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int):
        if repeats != 1:
            self._refuse("expanding the cache's batch")

    def batch_select_indices(self, indices):
        self._refuse("selecting from the cache's batch")


class ContinuumLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A ContinuumLM :class:`LanguageModel` (``self.model``) for transformers' tools.

    ``forward(input_ids, attention_mask=None, labels=None, cache=None, use_cache=None)``
    returns ``CausalLMOutputWithPast``; ``labels`` are shifted inside, as in every transformers
    causal LM (-100 is ignored). ``generate`` decodes incrementally through
    :class:`ContinuumLMCache`. Padding is refused: an ``attention_mask`` must be all ones."""

    config_class = ContinuumLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys = {"model.lm_head.weight": "model.tok_emb.weight"}
    _no_split_modules: list[str] = []

    def __init__(self, config: ContinuumLMConfig, model: LanguageModel | None = None):
        super().__init__(config)
        self.model = model if model is not None else LanguageModel(config.to_model_config())
        self.post_init()

    def _init_weights(self, module):
        """Nothing: :class:`LanguageModel` initializes its own weights when it is built."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the forward builds a ContinuumLMCache; a DynamicCache cannot serve it

    def get_input_embeddings(self):
        return self.model.tok_emb

    def get_output_embeddings(self):
        return self.model.lm_head

    def forward(self, input_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None,
                cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None,
                use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0,
                **kwargs) -> CausalLMOutputWithPast:
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("ContinuumLMForCausalLM reads input_ids (inputs_embeds are not "
                             "supported).")
        if kwargs.get("past_key_values") is not None:
            raise ValueError("pass the decoding state as cache=... (transformers 5's name), not "
                             "past_key_values.")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "ContinuumLMForCausalLM does not support padded batches: the attention_mask holds "
                "zeros, and the model's mixers (DeltaNet's recurrence, continuous attention, "
                "learned and rotary positions) would read the pad tokens. Generate or score "
                "each sequence on its own (batch size 1), or batch sequences of one length.")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is not None and not isinstance(cache, ContinuumLMCache):
            raise ValueError(f"cache must be a ContinuumLMCache (the model's own decoding "
                             f"state), not {type(cache).__name__}; leave it out and the model "
                             f"makes one.")
        if cache is None and use_cache:
            cache = ContinuumLMCache(self.model.init_state(input_ids.shape[0]))
        state = cache.state if cache is not None else None
        if position_ids is not None:
            start = state.pos if state is not None else 0
            expected = torch.arange(start, start + input_ids.shape[1], device=position_ids.device)
            if not bool((position_ids == expected).all()):
                raise ValueError("position_ids must count on from the cache (0, 1, 2, ... without "
                                 "gaps): positions come from the decoding state.")
        h = self.model.hidden_states(input_ids, state)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        logits = self.model.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1).to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

    # -------------------------------------------------------------- persistence

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None,
                        ode_solver: str | None = None, ode_steps: int | None = None,
                        dtype=None, torch_dtype=None, device_map=None, **kwargs):
        """Load a ContinuumLM checkpoint folder (or a Hub repository holding one). The weights
        are read with ContinuumLM's own loader (safetensors, checked against config.json);
        ``ode_solver`` / ``ode_steps`` integrate an ODE model's trained fields with another
        solver or step count (anytime depth, as ``continuumlm eval --ode-steps``); ``dtype``
        casts, ``device_map`` (one device: "cpu", "cuda", "cuda:1", ...) places the model."""
        path = Path(pretrained_model_name_or_path)
        name = str(pretrained_model_name_or_path)
        if not path.is_dir() and (path.exists() or name.startswith((".", "/", "~"))
                                  or name.count("/") > 1):
            raise CheckpointError(f"{name} is not a folder: name a ContinuumLM checkpoint folder "
                                  f"(config.json + model.safetensors) or a Hub repository id "
                                  f"(owner/name).")
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(str(pretrained_model_name_or_path),
                                          **{k: kwargs[k] for k in ("revision", "token",
                                                                    "cache_dir") if k in kwargs}))
        cfg_file = path / "config.json"
        if cfg_file.is_file():
            import json

            try:
                kind = json.loads(cfg_file.read_text()).get("model_type")
            except (ValueError, AttributeError):
                kind = None  # ContinuumLM's loader below names what is wrong with the file
            if kind not in (None, ContinuumLMConfig.model_type):
                raise CheckpointError(f"{path} holds a {kind!r} model (config.json model_type), "
                                      f"not a ContinuumLM one; load it with its own class.")
        if config is None or not isinstance(config, ContinuumLMConfig):
            hf_keys = {k: kwargs[k] for k in ("use_cache",) if k in kwargs}
            config = ContinuumLMConfig.from_pretrained(path, **hf_keys)
        elif cfg_file.is_file():
            # the Auto classes hand ode_solver= / ode_steps= to the config (AutoConfig keeps a
            # keyword that names one of its attributes), not to this method: a solver that
            # differs from the folder's is a request, checked and applied like the keywords
            folder = ContinuumLMConfig.from_pretrained(path)
            asked = {k: getattr(config, k) for k in ("ode_solver", "ode_steps")
                     if getattr(config, k) != getattr(folder, k)}
            if asked:
                ode_solver = ode_solver if ode_solver is not None else asked.get("ode_solver")
                ode_steps = ode_steps if ode_steps is not None else asked.get("ode_steps")
                config = ContinuumLMConfig.from_dict(
                    {**config.to_dict(), **{k: getattr(folder, k) for k in asked}})
        mcfg = config.to_model_config()
        lm = LanguageModel(mcfg)
        load_weights(lm, path)
        if ode_solver is not None or ode_steps is not None:
            try:
                lm.set_solver(ode_solver, ode_steps, ode_grad="direct")
            except ValueError as e:
                raise CheckpointError(f"{path}: {e}") from None
            # the loaded config with the new solver (its eos/bos ids, auto_map... kept)
            config = ContinuumLMConfig.from_dict({**config.to_dict(), **lm.config.to_dict()})
        model = cls(config, model=lm)
        if (path / "generation_config.json").is_file():
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(path)
        dtype = dtype if dtype is not None else torch_dtype
        if dtype not in (None, "auto"):
            model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        if isinstance(device_map, dict):  # accelerate's form; {"": device} is one device
            devices = set(device_map.values())
            if len(devices) != 1:
                raise ValueError(f"device_map {device_map} splits the model across devices; "
                                 f"ContinuumLM models live on one device (e.g. 'cuda').")
            device_map = devices.pop()
            device_map = f"cuda:{device_map}" if isinstance(device_map, int) else device_map
        if device_map is not None:
            model = model.to("cuda" if device_map == "auto" and torch.cuda.is_available()
                             else ("cpu" if device_map == "auto" else device_map))
            if lm.config.tie_embeddings:
                lm.lm_head.weight = lm.tok_emb.weight
        model.eval()
        return model

    def save_pretrained(self, save_directory, **kwargs):
        """config.json (this config: every ModelConfig field and model_type) and
        model.safetensors, as ContinuumLM writes them (the tied head stored once)."""
        directory = Path(save_directory)
        self.model.save_pretrained(directory)
        self.config.save_pretrained(directory)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(directory)
