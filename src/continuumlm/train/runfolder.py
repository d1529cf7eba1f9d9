"""The old import path of :mod:`continuumlm.runs.folder` (the run folder's layout)."""

from ..runs.folder import *  # noqa: F403
