"""The CPU emulation of CUDA-graph capture, kept importable here; it lives in
:mod:`continuumlm.decoding.replay` beside the CUDA recorder it stands in for."""

from .decoding.replay import CaptureError, EmulatedGraph, EmulatedGraphRecorder

__all__ = ["CaptureError", "EmulatedGraph", "EmulatedGraphRecorder"]
