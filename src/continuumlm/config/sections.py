"""The config sections, one module each: [model] (model.py), [data] (data.py), [train]
(train.py), [mqar] (mqar.py) and the run config that holds them (run.py). Importable from
here as before."""

from .data import DataConfig
from .model import GRAD_MODES, ODE_KV, ModelConfig, _check_selectors
from .mqar import MQARConfig
from .run import SECTIONS, RunConfig, _build, solve_nfe, solve_pairs
from .train import TrainConfig

__all__ = ["GRAD_MODES", "ODE_KV", "SECTIONS", "DataConfig", "MQARConfig", "ModelConfig",
           "RunConfig", "TrainConfig", "_build", "_check_selectors", "solve_nfe", "solve_pairs"]
