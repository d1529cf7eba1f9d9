"""``ContinuumLMForCausalLM``: a ``LanguageModel`` behind transformers' ``PreTrainedModel`` and
``GenerationMixin``, and ``ContinuumLMCache``, the model's own decoding state as a ``Cache``."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
from pathlib import Path

import torch
import torch.nn as nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..atomic import atomic_folder
from ..errors import CheckpointError
from ..model.depth import ODEBlock, TransformerBlock
from ..model.lm import LanguageModel, load_weights
from .cache import CACHE_FIELD, ContinuumLMCache  # noqa: F401 - importable here as before
from .configuration import AUTO_MAP, ContinuumLMConfig, write_remote_code
from .folders import BASE_MODEL_PREFIX, load_state_dict, own_names


# the decoding state's name in transformers' outputs and keywords: "cache" from 5.24 (where
# past_key_values is a deprecated alias), "past_key_values" in earlier 5.x releases
class CheckpointedTransformerBlock(TransformerBlock, GradientCheckpointingLayer):
    """A discrete layer that is also transformers' ``GradientCheckpointingLayer``, the type
    its checkpointing finds the repeated layers by. The layer checkpoints itself already (its
    flag and function have transformers' names), so it keeps ``nn.Module``'s call and its own
    ``forward`` rather than the wrapper transformers gives a subclass. A class of this module
    (not made on the fly), so a wrapped model pickles."""

    __call__ = nn.Module.__call__


class CheckpointedODEBlock(ODEBlock, GradientCheckpointingLayer):
    """An ODE block as a ``GradientCheckpointingLayer`` (as CheckpointedTransformerBlock)."""

    __call__ = nn.Module.__call__


# GradientCheckpointingLayer wraps a subclass's forward when the class is made: undo it
CheckpointedTransformerBlock.forward = TransformerBlock.forward
CheckpointedODEBlock.forward = ODEBlock.forward
CHECKPOINTED = {TransformerBlock: CheckpointedTransformerBlock, ODEBlock: CheckpointedODEBlock}


class ContinuumLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A ContinuumLM :class:`LanguageModel` (``self.model``) for transformers' tools.

    ``forward(input_ids, attention_mask=None, position_ids=None, cache=None,
    inputs_embeds=None, labels=None, use_cache=None, output_hidden_states=None,
    return_dict=None)`` returns ``CausalLMOutputWithPast``; ``labels`` are shifted inside, as
    in every transformers causal LM (-100 is ignored). ``generate`` decodes incrementally
    through :class:`ContinuumLMCache`. A padded ``attention_mask`` (left or right) is honoured
    by the mixers that support padding (softmax attention, DeltaNet): each row's outputs at
    its real tokens are the row's alone."""

    config_class = ContinuumLMConfig
    base_model_prefix = BASE_MODEL_PREFIX
    main_input_name = "input_ids"
    _tied_weights_keys = {"model.lm_head.weight": "model.tok_emb.weight"}
    _no_split_modules: list[str] = []
    supports_gradient_checkpointing = True  # per layer, or per ODE block (its whole solve)
    _supports_sdpa = True  # the attention mixers run scaled_dot_product_attention

    def __init__(self, config: ContinuumLMConfig, model: LanguageModel | None = None):
        super().__init__(config)
        self.model = model if model is not None else LanguageModel(config.to_model_config())
        for layer in getattr(self.model.depth, "layers", getattr(self.model.depth, "blocks", [])):
            if type(layer) in CHECKPOINTED:  # a plugin's depth keeps its own layer types
                layer.__class__ = CHECKPOINTED[type(layer)]
        self.post_init()

    def post_init(self):
        # the LanguageModel initialized itself (or holds the weights just loaded): transformers'
        # initialization, which post_init runs, skips modules marked initialized. The marks go
        # again, so an explicit init_weights() (after to_empty, say) initializes everything.
        modules = list(self.model.modules())
        for m in modules:
            m._is_hf_initialized = True
        try:
            super().post_init()
        finally:
            for m in modules:
                m.__dict__.pop("_is_hf_initialized", None)

    def initialize_weights(self):
        # every module's own tensors come from a freshly built LanguageModel (the one place
        # that knows how each is drawn: residual scaling, identity convolutions, zeroed time
        # embeddings, RoPE tables...), built once per pass and only when a module needs it
        self._fresh = None
        self._names = {m: n for n, m in self.model.named_modules()}
        try:
            super().initialize_weights()
        finally:
            del self._fresh, self._names

    def _init_weights(self, module):
        """``LanguageModel``'s initialization: inside ``initialize_weights`` (a model made on
        the meta device and materialized with ``to_empty``), a module's own parameters and
        buffers from a freshly built model; called on its own (``resize_token_embeddings``'s
        new rows), a linear or embedding module drawn as ``LanguageModel`` draws them."""
        name = getattr(self, "_names", {}).get(module)
        if name is not None:
            if self._fresh is None:
                device = next(iter(self.model.parameters())).device
                with torch.device(device):
                    self._fresh = dict(LanguageModel(self.model.config).named_modules())
            src = self._fresh[name]
            with torch.no_grad():
                for kind in ("named_parameters", "named_buffers"):
                    theirs = dict(getattr(src, kind)(recurse=False))
                    for n, t in getattr(module, kind)(recurse=False):
                        t.copy_(theirs[n])
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            LanguageModel._init_weights(module)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the forward builds a ContinuumLMCache; a DynamicCache cannot serve it

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' preparation, and for assisted and prompt-lookup decoding (which need
        the cache before the first forward; batch 1) the model's own ContinuumLMCache."""
        out = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args,
                                                    **kwargs)
        bound = inspect.signature(super()._prepare_cache_for_generation).bind_partial(
            generation_config, model_kwargs, *args, **kwargs).arguments
        mode = getattr(bound.get("generation_mode"), "value", bound.get("generation_mode"))
        if (mode == "assisted_generation" and model_kwargs.get(CACHE_FIELD) is None
                and generation_config.use_cache is not False and bound.get("batch_size")):
            model_kwargs[CACHE_FIELD] = ContinuumLMCache(
                self.model.init_state(bound["batch_size"], ContinuumLMCache.REWIND))
        return out

    def get_input_embeddings(self):
        return self.model.tok_emb

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.tok_emb = value
        self._sync_vocab(value.num_embeddings)

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.model.lm_head = new_embeddings

    def resize_token_embeddings(self, *args, **kwargs):
        out = super().resize_token_embeddings(*args, **kwargs)
        self._sync_vocab(self.model.tok_emb.num_embeddings)
        return out

    def _sync_vocab(self, n: int) -> None:
        """The wrapped model's own config follows the embedding's size (it is what saving
        writes and loading builds)."""
        if self.model.config.vocab_size != n:
            self.model.config = dataclasses.replace(self.model.config, vocab_size=n)
            self.config.vocab_size = n

    # drafts made by the model's own first layers, or by multi-token heads: not this model's
    # structure (ContinuumLM's own self-speculation drafts through a coarser solve instead)
    UNSUPPORTED_DRAFTS = ("assistant_early_exit", "use_mtp")

    def as_draft(self, solver: str = "euler", steps: int = 1) -> ContinuumLMForCausalLM:
        """This model with its ODE blocks integrated by ``solver`` x ``steps``, sharing every
        weight: an assistant for transformers' assisted decoding that drafts through a coarser
        solve of the same fields (``generate(..., assistant_model=model.as_draft())``). Only
        the blocks' solvers and configs are its own; the model is left as it is."""
        lm = self.model
        if lm.config.depth != "ode":
            raise ValueError("as_draft: a discrete model has no solve to integrate more "
                             "coarsely; draft with a smaller model (assistant_model=) instead.")
        draft = copy.copy(lm)  # the same parameters and buffers; own module tables below
        draft._modules = dict(lm._modules)
        depth = copy.copy(lm.depth)
        depth._modules = dict(lm.depth._modules)
        blocks = nn.ModuleList()
        for b in lm.depth.blocks:
            nb = copy.copy(b)
            nb._modules = dict(b._modules)
            blocks.append(nb)
        depth.blocks = blocks
        draft.depth = depth
        draft.set_solver(solver, steps, ode_grad="direct")
        if not getattr(draft.depth.blocks[0].solver, "fixed_grid", True):
            raise ValueError(f"as_draft: {solver!r} is an adaptive solver; a draft needs a "
                             f"fixed-grid solver (euler, midpoint, rk4, ...).")
        config = copy.deepcopy(self.config)
        config.ode_solver, config.ode_steps, config.ode_grad = solver, steps, "direct"
        out = type(self)(config, model=draft)
        out.generation_config = copy.deepcopy(self.generation_config)
        return out.eval()

    def generate(self, *args, **kwargs):
        """transformers' ``generate``. Assisted decoding (``assistant_model=``, a smaller
        model sharing the tokenizer) and prompt-lookup decoding (``prompt_lookup_num_tokens=``)
        cut the decoding state back after rejected drafts (:meth:`ContinuumLMCache.crop`);
        early-exit and multi-token-prediction drafts are refused by name."""
        configs = [kwargs, kwargs.get("generation_config"), self.generation_config]
        for name in self.UNSUPPORTED_DRAFTS:
            if any(getattr(c, name, None) if not isinstance(c, dict) else c.get(name)
                   for c in configs if c is not None):
                raise NotImplementedError(
                    f"{name}: drafting with the model's first layers or with extra prediction "
                    f"heads needs a structure ContinuumLM's models do not have; use "
                    f"assistant_model= (a smaller model) or prompt_lookup_num_tokens=.")
        return super().generate(*args, **kwargs)

    def forward(self, input_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None,
                cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None,
                use_cache: bool | None = None,
                output_attentions: bool | None = None,
                output_hidden_states: bool | None = None,
                return_dict: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0,
                **kwargs) -> CausalLMOutputWithPast | tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds.")
        if cache is None and kwargs.get("past_key_values") is not None:
            cache = kwargs.pop("past_key_values")  # the name before transformers 5
        kwargs.pop("past_key_values", None)
        if output_attentions if output_attentions is not None else \
                self.config.output_attentions:
            raise ValueError("output_attentions: ContinuumLM's mixers form no attention maps "
                             "to return (DeltaNet and the ODE fields have none, softmax runs "
                             "fused); leave it off.")
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and self.training and any(getattr(m, "gradient_checkpointing", False)
                                               for m in self.modules()):
            # a checkpointed layer runs twice; a cache would take its tokens twice
            use_cache, cache = False, None
        if cache is not None and not isinstance(cache, ContinuumLMCache):
            if cache.get_seq_length() == 0:  # an empty cache of another kind: make ours
                cache = None
            else:
                raise ValueError(f"cache must be a ContinuumLMCache (the model's own decoding "
                                 f"state), not {type(cache).__name__}; leave it out and the "
                                 f"model makes one.")
        batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        if cache is None and use_cache:
            cache = ContinuumLMCache(self.model.init_state(batch, ContinuumLMCache.REWIND))
        state = cache.state if cache is not None else None
        record = [] if output_hidden_states else None
        h = self.model.hidden_states(input_ids, state, attention_mask=attention_mask,
                                     position_ids=position_ids, embeds=inputs_embeds,
                                     record=record)
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
        else:
            h = h[:, logits_to_keep]
        logits = self.model.lm_head(h)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(loss=loss, logits=logits,
                                     **{CACHE_FIELD: cache if use_cache else None},
                                     hidden_states=tuple(record) if record is not None else None)
        return out if return_dict else out.to_tuple()

    # -------------------------------------------------------------- persistence

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None,
                        state_dict: dict | None = None, output_loading_info: bool = False,
                        ode_solver: str | None = None, ode_steps: int | None = None,
                        dtype=None, torch_dtype=None, device_map=None, **kwargs):
        """Load a ContinuumLM checkpoint folder (or a Hub repository holding one). The weights
        are read with ContinuumLM's own loader (safetensors, checked against config.json), or
        from ``state_dict`` when given (with ``pretrained_model_name_or_path=None`` and a
        ``config``, nothing is read from disk); ``ode_solver`` / ``ode_steps`` integrate an
        ODE model's trained fields with another solver or step count (anytime depth, as
        ``continuumlm eval --ode-steps``); ``dtype`` casts, ``device_map`` (one device: "cpu",
        "cuda", "cuda:1", ...) places the model. Loading is strict, so
        ``output_loading_info`` reports no missing or unexpected keys."""
        from transformers.modeling_utils import get_torch_context_manager_or_global_device

        if get_torch_context_manager_or_global_device() == torch.device("meta"):
            raise RuntimeError(
                "You are using `from_pretrained` with a meta device context manager or "
                "torch.set_default_device('meta'): the weights would be read into tensors "
                "without storage. Load outside the context, or build an empty model with "
                "ContinuumLMForCausalLM(config) inside it.")
        if pretrained_model_name_or_path is None:
            if config is None or state_dict is None:
                raise ValueError("from_pretrained(None, ...) builds the model from config= "
                                 "and state_dict=; give both, or name a checkpoint folder.")
            if not isinstance(config, ContinuumLMConfig):
                raise ValueError(f"config must be a ContinuumLMConfig, not "
                                 f"{type(config).__name__}.")
            lm = LanguageModel(config.to_model_config())
            load_state_dict(lm, state_dict, "the state_dict")
            model = cls(config, model=lm)
            return cls._finish_loading(model, lm, ode_solver, ode_steps, dtype, torch_dtype,
                                       device_map, None, output_loading_info)
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
        if state_dict is not None:
            load_state_dict(lm, state_dict, "the state_dict")
        else:
            load_weights(lm, path)
        model = cls(config, model=lm)
        return cls._finish_loading(model, lm, ode_solver, ode_steps, dtype, torch_dtype,
                                   device_map, path, output_loading_info)

    @classmethod
    def _finish_loading(cls, model, lm, ode_solver, ode_steps, dtype, torch_dtype, device_map,
                        path: Path | None, output_loading_info: bool):
        config = model.config
        if ode_solver is not None or ode_steps is not None:
            try:
                lm.set_solver(ode_solver, ode_steps, ode_grad="direct")
            except ValueError as e:
                raise CheckpointError(f"{path or 'the model'}: {e}") from None
            # the loaded config with the new solver (its eos/bos ids, auto_map... kept)
            model.config = ContinuumLMConfig.from_dict({**config.to_dict(),
                                                        **lm.config.to_dict()})
        if path is not None and (path / "generation_config.json").is_file():
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
        if output_loading_info:  # the loaders are strict: anything amiss raised above
            return model, {"missing_keys": set(), "unexpected_keys": set(),
                           "mismatched_keys": set(), "error_msgs": []}
        return model

    def save_pretrained(self, save_directory, is_main_process: bool = True,
                        state_dict: dict | None = None, push_to_hub: bool = False,
                        max_shard_size="50GB", variant: str | None = None,
                        safe_serialization: bool = True, **kwargs):
        """A complete folder or none: ``config.json`` (every ModelConfig field, model_type,
        ``auto_map``), the two one-line remote-code modules ``auto_map`` names (so the folder
        loads with ``trust_remote_code=True`` in a process that never imported
        ``continuumlm.hf``), ``generation_config.json`` and ``model.safetensors`` (the tied
        head stored once; ``state_dict`` when given, e.g. a trainer's). The files are written
        into a temporary folder beside the target and moved in, config.json last."""
        if not is_main_process:
            return
        if push_to_hub:
            raise NotImplementedError("push_to_hub: save the folder, then upload it with "
                                      "huggingface_hub.upload_folder(repo_id=..., "
                                      "folder_path=...).")
        if variant is not None or not safe_serialization:
            raise ValueError("ContinuumLM saves one model.safetensors (no variants, no pickle).")
        with atomic_folder(save_directory) as tmp:
            self._write_folder(tmp, state_dict)
        # the saved folder names its remote code: the config says so from now on, as
        # transformers' own saving of a remote-code model sets it
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP}
        self.config.architectures = [type(self).__name__]

    def _write_folder(self, out: Path, state_dict: dict | None) -> None:
        from safetensors.torch import save_file, save_model

        from ..model.lm import MODEL_TYPE, WEIGHTS_FILE

        lm = self.model
        if state_dict is None:
            save_model(lm, str(out / WEIGHTS_FILE))
        else:
            tensors = own_names(lm, state_dict, "the state_dict")
            save_file({k: v.detach().contiguous() for k, v in tensors.items()},
                      str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        write_remote_code(out)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(out)
        cfg = {**self.config.to_dict(), **lm.config.to_dict(), "model_type": MODEL_TYPE,
               "auto_map": {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP},
               "architectures": [type(self).__name__]}
        cfg.pop("_name_or_path", None)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
