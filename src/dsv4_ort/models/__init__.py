"""Reference DeepSeek-V4 model in PyTorch: configuration, fused-region functions (op specs), model.

The torch-free modules (``config``, ``inventory``, ``errors``, ``synthetic``, ``quant_np``, ``rope``) import without
torch, so the names below are resolved on first use: ``from dsv4_ort.models import DeepseekV4Config`` does not
import torch, ``DeepseekV4ForCausalLM`` does.
"""

_LAZY = {
    "PRESETS": "config", "DeepseekV4Config": "config", "DeepseekV4ForCausalLM": "model",
    "DeepseekV4State": "model", "LayerState": "model",
}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name == "functional":
        return importlib.import_module(".functional", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PRESETS", "DeepseekV4Config", "DeepseekV4ForCausalLM", "DeepseekV4State", "LayerState", "functional"]
