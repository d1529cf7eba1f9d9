from .sampling import filter_logits, sample_next

__all__ = ["filter_logits", "sample_next"]
