"""Reference DeepSeek-V4 model in PyTorch: configuration, fused-region functions (op specs), model.

The torch-free modules (``config``, ``inventory``, ``errors``, ``synthetic``, ``quant_np``, ``rope``) import without
torch, so the names below are resolved on first use: ``from dsv4_ort.models import DeepseekV4Config`` does not
import torch, ``DeepseekV4ForCausalLM`` does.
"""

_MODULES = {  # public names of each module, resolved on first use
    "config": ("PRESETS", "DeepseekV4Config"),
    "model": ("DeepseekV4ForCausalLM", "DeepseekV4State", "LayerState"),
    "errors": ("CheckpointError", "CheckpointNotFoundError", "MissingTensorError", "UnexpectedTensorError",
               "ShapeMismatchError", "DtypeMismatchError", "CorruptCheckpointError", "UnsupportedModelError"),
    "inventory": ("TensorSpec", "deepseek_tensor_specs", "cfg_dict"),
    "naming": ("NAMINGS", "HFSlot", "detect_naming", "deepseek_to_hf", "hf_to_deepseek", "scale_name",
               "hf_state_dict_to_deepseek", "deepseek_state_dict_to_hf", "saved_to_deepseek", "deepseek_to_saved"),
    "safetensors_io": ("ShardReader",),
    "checkpoint": ("INDEX_FILE", "RawTensor", "Checkpoint", "open_checkpoint", "iter_checkpoint", "read_config_dict"),
    "loading": ("load_model",),
    "random_checkpoint": ("random_tensors", "write_random_checkpoint"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name == "functional":
        return importlib.import_module(".functional", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_LAZY, "functional"]
