"""The old import path of :mod:`continuumlm.runs.checkpoint` (a run's checkpoints)."""

from ..runs.checkpoint import *  # noqa: F403
from ..runs.checkpoint import _write_manifest  # noqa: F401 - importable here as before
