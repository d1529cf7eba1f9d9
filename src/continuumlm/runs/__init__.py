"""A run on disk: the run folder (``folder.py``: its layout, every name in it spelled once, and
the errors of a folder that cannot be used) and its checkpoints (``checkpoint.py``: written
atomically, verified, loaded). Below training, so that evaluation, generation and the
adapters load a run without importing the trainer."""

from .checkpoint import load_model_and_tokenizer, load_run_config, resolve_checkpoint

__all__ = ["load_model_and_tokenizer", "load_run_config", "resolve_checkpoint"]
