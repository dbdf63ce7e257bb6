"""Tessera models: plain single-device PyTorch; parallelism is applied from outside by FQN."""

from models.config import PRESETS, ModelConfig, MoEConfig, model_config
from models.decoder import Decoder, build_model
from models.flops import flops_per_token, num_params, param_counts

__all__ = [
           "PRESETS",
           "Decoder",
           "MoEConfig",
           "ModelConfig",
           "build_model",
           "flops_per_token",
           "model_config",
           "num_params",
           "param_counts",
]
