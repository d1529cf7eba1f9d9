"""Evaluation: perplexity over a split at one or more context lengths."""
