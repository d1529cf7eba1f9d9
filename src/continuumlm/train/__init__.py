from ..runs.checkpoint import load_model_and_tokenizer, resolve_checkpoint, save_checkpoint
from .trainer import Trainer, evaluate_loss, pick_device

__all__ = ["Trainer", "evaluate_loss", "load_model_and_tokenizer", "pick_device",
           "resolve_checkpoint", "save_checkpoint"]
