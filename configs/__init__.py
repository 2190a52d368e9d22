"""Typed run configs: the schema of a run, the loss presets, and the YAML loader.

from staleflow.configs import load_config
cfg = load_config("configs/quickstart.yaml", ["learner.loss.epsilon_high=2.0"])
"""

from staleflow.configs.loader import ConfigError, dump_config, load_config, parse_config
from staleflow.configs.losses import LOSS_PRESETS, AdvantageConfig, LossConfig, LossPreset
from staleflow.configs.schema import RunConfig

__all__ = [
    "LOSS_PRESETS",
    "AdvantageConfig",
    "ConfigError",
    "LossConfig",
    "LossPreset",
    "RunConfig",
    "dump_config",
    "load_config",
    "parse_config",
]
