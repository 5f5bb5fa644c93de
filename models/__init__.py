"""Reference DeepSeek-V4 model in PyTorch: configuration, fused-region functions (op specs), model."""

from . import functional
from .config import PRESETS, DeepseekV4Config
from .model import DeepseekV4ForCausalLM, DeepseekV4State, LayerState

__all__ = ["PRESETS", "DeepseekV4Config", "DeepseekV4ForCausalLM", "DeepseekV4State", "LayerState", "functional"]
