"""Building the reference model from a checkpoint: parameters created on the meta device, each checkpoint tensor
dequantised and put in place, every model tensor checked present once with the right shape."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from .checkpoint import CONFIG_FILE, Checkpoint, read_config_dict
from .errors import (
    DtypeMismatchError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedModelError,
)

__all__ = ["load_model"]


@contextlib.contextmanager
def _parameters_on_meta(model_cls=None):
    """Create module parameters on the meta device (buffers stay real, e.g. RoPE tables).

    ``model_cls.init_weights`` (random initialisation, pointless before loading) is disabled meanwhile.
    """
    orig = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        orig(module, name, param)

    init = model_cls.__dict__.get("init_weights") if model_cls is not None else None
    torch.nn.Module.register_parameter = register
    if init is not None:
        model_cls.init_weights = lambda self, *a, **k: None
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = orig
        if init is not None:
            model_cls.init_weights = init


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    validate: bool = True,
    config: Any = None,
):
    """Build :class:`DeepseekV4ForCausalLM` from a checkpoint directory, streaming weights in.

    ``DeepseekV4ForCausalLM(config, dtype=dtype)`` is built with its parameters on the meta device;
    each checkpoint tensor (either naming, any of the weight formats) is dequantised exactly, cast to
    the dtype the model declares for it (``dtype`` for matrices and embeddings; the model keeps norms,
    mHC, sinks, ape and gate bias in float32) and assigned in place of the meta parameter, so no
    second copy of the model is ever held. Every model tensor must be present exactly once with the
    right shape, else a :class:`CheckpointError` subclass names the tensor and the file.
    ``config``: use this :class:`DeepseekV4Config` instead of the checkpoint's config.json
    (which must still exist and name a DeepSeek-V4 model).
    """
    from .config import DeepseekV4Config
    from .model import DeepseekV4ForCausalLM

    path = os.fspath(path)
    cfg_dict = read_config_dict(path)
    if config is None:
        try:
            config = DeepseekV4Config.from_dict(cfg_dict)
        except (TypeError, ValueError) as e:
            cfg_file = os.path.join(_dir_of(path), CONFIG_FILE)
            raise UnsupportedModelError(f"invalid config ({e})", file=cfg_file) from None
    ck = Checkpoint(path)
    if config.num_nextn_predict_layers and not ck.has_mtp:
        # transformers builds no MTP block, so what it saves says num_nextn_predict_layers yet holds no mtp.* tensor:
        # load the main model, MTP absent (model.mtp is empty), as transformers does.
        config = config.replace(num_nextn_predict_layers=0, compress_ratios=config.layer_ratios)
    with _parameters_on_meta(DeepseekV4ForCausalLM):
        model = DeepseekV4ForCausalLM(config, dtype=dtype)
    slots: dict[str, tuple[torch.nn.Module, str, bool, torch.Tensor]] = {}
    for mod_name, mod in model.named_modules():
        prefix = mod_name + "." if mod_name else ""
        for leaf, p in mod._parameters.items():
            if p is not None:
                slots[prefix + leaf] = (mod, leaf, True, p)
        for leaf, b in mod._buffers.items():
            if b is not None and leaf not in mod._non_persistent_buffers_set:
                slots[prefix + leaf] = (mod, leaf, False, b)
    loaded: dict[str, str] = {}
    for rt in ck.iter_raw():
        name = rt.name
        if name not in slots:
            raise UnexpectedTensorError("checkpoint tensor has no place in the model", tensor=name, file=rt.file)
        if name in loaded:
            raise UnexpectedTensorError(f"tensor appears twice (also in {loaded[name]})", tensor=name, file=rt.file)
        mod, leaf, is_param, ref = slots[name]
        if tuple(rt.shape) != tuple(ref.shape):
            raise ShapeMismatchError(
                f"shape {tuple(rt.shape)} in the checkpoint, {tuple(ref.shape)} in the model",
                tensor=name, file=rt.file)
        t = rt.dequantize(None, validate=validate)
        if ref.is_floating_point() != t.is_floating_point():
            raise DtypeMismatchError(f"dtype {t.dtype} in the checkpoint, {ref.dtype} in the model", name, rt.file)
        t = t.to(ref.dtype)
        if is_param:
            mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[leaf] = t
        loaded[name] = rt.file
        del t, rt
    missing = [n for n in slots if n not in loaded]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingTensorError(f"model tensor not found in the checkpoint{more}", tensor=missing[0], file=ck.location)
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if still_meta:
        raise MissingTensorError("model tensor left uninitialised", tensor=still_meta[0], file=ck.location)
    model.eval()
    return model


def _dir_of(path: str) -> str:
    return path if os.path.isdir(path) else os.path.dirname(path)
