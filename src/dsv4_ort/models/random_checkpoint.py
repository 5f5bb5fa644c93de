"""Synthetic checkpoints: deterministic random weights (values from :mod:`.synthetic`, the inventory from
:mod:`.inventory`) written in any naming and weight format, shard by shard."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from . import quant as Q
from .checkpoint import ARCHITECTURE, CONFIG_FILE, INDEX_FILE, MODEL_TYPE, RawTensor
from .inventory import WEIGHT_MODES, TensorSpec, cfg_dict, deepseek_tensor_specs, storage_kind
from .naming import deepseek_to_hf, scale_name
from .safetensors_io import ST_DTYPES, StreamingShardWriter
from .synthetic import make_array

_storage_kind = storage_kind


def random_tensors(
    config: Any, weights: str = "bf16", seed: int = 0, raw: bool = False, names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]] | Iterator[RawTensor]:
    """The tensors :func:`write_random_checkpoint` writes, one at a time, in DeepSeek naming.

    ``raw=False``: ``(name, exact dense value)`` (float32 for quantised weights, stored dtype
    otherwise); ``raw=True``: :class:`RawTensor` with the stored data and scale. ``names``: only
    generate these (each value depends only on seed, weights mode and name).
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    c = cfg_dict(config)
    keep = None if names is None else set(names)
    for spec in deepseek_tensor_specs(c):
        if keep is not None and spec.name not in keep:
            continue
        rt = _make_raw(spec, weights, seed, c)
        yield rt if raw else (rt.name, rt.dequantize(None))


def _make_raw(spec: TensorSpec, weights: str, seed: int, c: dict) -> RawTensor:
    """One tensor of :mod:`.synthetic` in its stored form, as torch tensors sharing the numpy memory."""
    a = make_array(spec, weights, seed, c)
    if a.stored == "fp8":
        return RawTensor(spec.name, torch.from_numpy(a.data).view(torch.float8_e4m3fn),
                         torch.from_numpy(a.scale).view(torch.float8_e8m0fnu), "fp8", "", a.block)
    if a.stored == "fp4":
        return RawTensor(spec.name, torch.from_numpy(a.data).view(torch.int8),
                         torch.from_numpy(a.scale).view(torch.float8_e8m0fnu), "fp4", "", a.block)
    if a.stored == "bf16":
        return RawTensor(spec.name, torch.from_numpy(a.data.view(np.int16)).view(torch.bfloat16), None, "dense", "")
    return RawTensor(spec.name, torch.from_numpy(a.data), None, "dense", "")

__all__ = ["random_tensors", "write_random_checkpoint"]


_ST_FOR_KIND = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64, "fp8": torch.float8_e4m3fn,
                "fp4": torch.int8}


def _scale_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "fp8":
        return (*shape[:-2], math.ceil(shape[-2] / Q.FP8_BLOCK), math.ceil(shape[-1] / Q.FP8_BLOCK))
    return (*shape[:-1], math.ceil(shape[-1] / Q.FP4_BLOCK))


def _stored_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-1], shape[-1] // 2) if kind == "fp4" else shape


@dataclasses.dataclass
class _Group:
    """Tensors written together (a weight and its scale, or a fused expert tensor and its scale)."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    make: Callable[[], dict[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * ST_DTYPES[dt][1] for _, dt, s in self.specs)


def _file_groups(c: dict, naming: str, weights: str, seed: int) -> list[_Group]:
    specs = deepseek_tensor_specs(c)
    scale_dt = torch.float8_e8m0fnu
    groups: list[_Group] = []
    if naming == "deepseek":
        for spec in specs:
            kind = _storage_kind(spec, weights)
            items = [(spec.name, _ST_FOR_KIND[kind], _stored_shape(kind, spec.shape))]
            if kind in ("fp8", "fp4"):
                items.append((scale_name(spec.name), scale_dt, _scale_shape(kind, spec.shape)))

            def make(spec=spec, kind=kind):
                rt = _make_raw(spec, weights, seed, c)
                out = {spec.name: rt.data}
                if rt.scale is not None:
                    out[scale_name(spec.name)] = rt.scale
                return out

            groups.append(_Group(items, make))
        return groups

    # transformers naming: 1:1 tensors, then fused experts per layer (after that layer's tensors)
    E, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    pending: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        slot = deepseek_to_hf(spec.name)
        kind = _storage_kind(spec, weights)
        if slot.expert is None:
            items = [(slot.name, _ST_FOR_KIND[kind], _stored_shape(kind, spec.shape))]
            sname = deepseek_to_hf(scale_name(spec.name)).name if spec.kind in ("linear", "expert") else None
            if kind in ("fp8", "fp4"):
                items.append((sname, scale_dt, _scale_shape(kind, spec.shape)))

            def make(spec=spec, slot=slot, sname=sname):
                rt = _make_raw(spec, weights, seed, c)
                out = {slot.name: rt.data}
                if rt.scale is not None:
                    out[sname] = rt.scale
                return out

            groups.append(_Group(items, make))
            continue
        pending.setdefault(slot.name, []).append(spec)
        if spec.name.endswith(f"experts.{E - 1}.w3.weight"):  # layer complete: emit its fused tensors
            for fused in (slot.name, slot.name.replace("gate_up_proj", "down_proj")):
                groups.append(_fused_group(fused, pending.pop(fused), kind, weights, seed, c, E, inter))
    assert not pending, sorted(pending)
    return groups


def _fused_group(hf_name: str, members: list[TensorSpec], kind: str, weights: str, seed: int, c: dict,
                 E: int, inter: int) -> _Group:
    gate_up = hf_name.endswith("gate_up_proj")
    per = {deepseek_to_hf(s.name)[1:]: s for s in members}  # (expert, part) -> spec
    one = members[0].shape
    shape = (E, 2 * inter, one[1]) if gate_up else (E, *one)
    if kind == "fp8" and gate_up and inter % Q.FP8_BLOCK:
        raise ValueError(
            f"FP8 experts in transformers naming need moe_intermediate_size % {Q.FP8_BLOCK} == 0 "
            f"(the fused gate_up_proj shares block scales), got {inter}")
    items = [(hf_name, _ST_FOR_KIND[kind], _stored_shape(kind, shape))]
    if kind in ("fp8", "fp4"):
        items.append((hf_name + "_scale_inv", torch.float8_e8m0fnu, _scale_shape(kind, shape)))

    def make():
        data = scale = None
        for e in range(E):
            parts = [per[(e, "gate")], per[(e, "up")]] if gate_up else [per[(e, None)]]
            rts = [_make_raw(s, weights, seed, c) for s in parts]
            d = torch.cat([r.data for r in rts]) if gate_up else rts[0].data
            if data is None:
                data = torch.empty((E, *d.shape), dtype=d.dtype)
            data[e] = d
            if rts[0].scale is not None:
                sc = torch.cat([Q.as_uint8(r.scale) for r in rts]) if gate_up else Q.as_uint8(rts[0].scale)
                if scale is None:
                    scale = torch.empty((E, *sc.shape), dtype=torch.uint8)
                scale[e] = sc
        out = {hf_name: data}
        if scale is not None:
            out[hf_name + "_scale_inv"] = scale.view(torch.float8_e8m0fnu)
        return out

    return _Group(items, make)


def _released_config(c: dict, weights: str) -> dict:
    d = dict(c)
    if weights in ("fp8", "native"):
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        d["expert_dtype"] = "fp4" if weights == "native" else "fp8"
    else:
        # explicit nulls: an absent key would mean the released FP8 / FP4 defaults
        d["quantization_config"] = None
        d["expert_dtype"] = "bf16" if weights == "bf16" else None
    d["torch_dtype"] = "float32" if weights == "fp32" else "bfloat16"
    return {k: v for k, v in d.items() if v is not None or k in ("quantization_config", "expert_dtype")}


def _hf_config(config: Any, c: dict, weights: str) -> dict:
    from .config import DeepseekV4Config

    cfg = config if isinstance(config, DeepseekV4Config) else DeepseekV4Config.from_dict(c)
    d = cfg.to_hf_dict()
    d["architectures"] = [ARCHITECTURE]
    d["model_type"] = MODEL_TYPE
    d["rope_theta"] = c["rope_theta"]
    d["compress_rope_theta"] = c["compress_rope_theta"]
    d["dtype"] = "float32" if weights == "fp32" else "bfloat16"
    if weights in ("fp8", "native"):
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                                    "expert_dtype": "fp4" if weights == "native" else "fp8"}
        return {k: v for k, v in d.items() if v is not None}
    # explicit nulls: an absent key would mean the released FP8 / FP4 defaults
    d["quantization_config"] = None
    d["expert_dtype"] = "bf16" if weights == "bf16" else None
    return {k: v for k, v in d.items() if v is not None or k in ("quantization_config", "expert_dtype")}


def write_random_checkpoint(
    path: str | os.PathLike,
    config: Any,
    naming: str = "deepseek",
    weights: str = "bf16",
    seed: int = 0,
    shard_size_bytes: int = 2**30,
) -> dict[str, str]:
    """Write a deterministic random checkpoint laid out like the release (or as transformers names it).

    ``config``: a :class:`DeepseekV4Config` or a config dict. ``naming``: ``"deepseek"`` (released
    names, ``.scale`` companions, released-style config.json) or ``"hf"`` (transformers module names,
    fused experts, ``*_scale_inv`` companions, transformers-style config.json; MTP tensors keep
    their DeepSeek names; with ``"fp8"`` / ``"native"`` weights transformers loads it into its FP8
    modules, which it keeps only with a GPU - on a CPU use ``"deepseek"``, see the module
    docstring). ``weights``:

    * ``"bf16"`` - every FP8/FP4 tensor of the release stored bf16 (fp32 ones stay fp32);
    * ``"fp32"`` - every floating tensor float32;
    * ``"fp8"`` - FP8 E4M3 + E8M0 128x128 block scales for all linears including routed experts
      (``expert_dtype: "fp8"``);
    * ``"native"`` - as released: FP8 linears, FP4 E2M1 routed experts (int8, two per byte, E8M0
      per 1x32), bf16 norms / compressor / gate / embed / head, fp32 mHC / sinks / ape / gate bias,
      int64 ``tid2eid``.

    Values depend only on ``seed`` and the DeepSeek tensor name, so both namings hold identical
    dense tensors; they are generated by :mod:`.synthetic` (numpy), which a preset export streams
    directly. Tensors are generated and written one at a time (peak memory ~ the largest
    tensor, for ``hf`` naming the largest fused expert tensor). Returns the weight map.
    """
    if naming not in ("deepseek", "hf"):
        raise ValueError(f"naming must be 'deepseek' or 'hf', got {naming!r}")
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    c = cfg_dict(config)
    groups = _file_groups(c, naming, weights, seed)

    shards: list[list[_Group]] = [[]]
    size = 0
    for g in groups:
        if shards[-1] and size + g.nbytes > shard_size_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += g.nbytes
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        specs = [s for g in shard for s in g.specs]
        w = StreamingShardWriter(os.path.join(path, fname), specs)
        try:
            for g in shard:
                tensors = g.make()
                for name, _, _ in g.specs:
                    w.write(name, tensors[name])
                    weight_map[name] = fname
                del tensors
        finally:
            w.f.close()
        w.close()
        total += w.total
    with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg_out = _released_config(c, weights) if naming == "deepseek" else _hf_config(config, c, weights)
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(cfg_out, f, indent=2)
    return weight_map
