"""The tensor inventory of DeepSeek-V4 (DeepSeek naming) and the storage format of each tensor per weight mode.

Torch-free: used by the checkpoint writer, the numpy random weights (:mod:`.synthetic`) and the exporter.
:mod:`dsv4_ort.models.checkpoint` re-exports :class:`TensorSpec` and :func:`deepseek_tensor_specs`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["TensorSpec", "deepseek_tensor_specs", "cfg_dict", "WEIGHT_MODES", "storage_kind"]

# Weight modes of synthetic checkpoints (see write_random_checkpoint).
WEIGHT_MODES = ("bf16", "fp32", "fp8", "native")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the released inventory (DeepSeek naming).

    ``kind``: ``"linear"`` (FP8 block-quantised in the release), ``"expert"`` (routed expert,
    FP4 in the release), ``"bf16"``, ``"fp32"``, ``"index"`` (int64 ``tid2eid``).
    ``init``: how random values are drawn (``"linear"``, ``"embed"``, ``"norm"``, ``"hc_fn"``,
    ``"hc_base"``, ``"hc_scale"``, ``"sink"``, ``"ape"``, ``"bias"``, ``"tid2eid"``).
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    init: str


def cfg_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        from .config import DeepseekV4Config

        return DeepseekV4Config.from_dict(config).to_dict()
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"expected a DeepseekV4Config or a dict, got {type(config).__name__}")


def deepseek_tensor_specs(config: Any) -> list[TensorSpec]:
    """The released tensor inventory (weights only, no ``.scale``) for a config, in file order."""
    c = cfg_dict(config)
    d, n_layers = c["hidden_size"], c["num_hidden_layers"]
    n_mtp = c.get("num_nextn_predict_layers", 0)
    H, D, dc = c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    G, dg = c["o_groups"], c["o_lora_rank"]
    nI, cI = c["index_n_heads"], c["index_head_dim"]
    E, K, inter = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    hc, V = c["hc_mult"], c["vocab_size"]
    ratios = c["compress_ratios"]
    mlp_types = c.get("mlp_layer_types")
    n_hash = c.get("num_hash_layers", 0)

    def is_hash(layer_id: int) -> bool:  # DeepseekV4Config.is_hash_layer on the dict
        if mlp_types is not None:
            return layer_id < n_layers and mlp_types[layer_id] == "hash_moe"
        return layer_id < n_hash
    mix = (2 + hc) * hc
    specs: list[TensorSpec] = []

    def add(name, shape, kind, init):
        specs.append(TensorSpec(name, tuple(int(s) for s in shape), kind, init))

    def block(p: str, layer_id: int, ratio: int):
        add(p + "hc_attn_fn", (mix, hc * d), "fp32", "hc_fn")
        add(p + "hc_attn_base", (mix,), "fp32", "hc_base")
        add(p + "hc_attn_scale", (3,), "fp32", "hc_scale")
        add(p + "hc_ffn_fn", (mix, hc * d), "fp32", "hc_fn")
        add(p + "hc_ffn_base", (mix,), "fp32", "hc_base")
        add(p + "hc_ffn_scale", (3,), "fp32", "hc_scale")
        add(p + "attn_norm.weight", (d,), "bf16", "norm")
        add(p + "ffn_norm.weight", (d,), "bf16", "norm")
        a = p + "attn."
        add(a + "attn_sink", (H,), "fp32", "sink")
        add(a + "wq_a.weight", (dc, d), "linear", "linear")
        add(a + "q_norm.weight", (dc,), "bf16", "norm")
        add(a + "wq_b.weight", (H * D, dc), "linear", "linear")
        add(a + "wkv.weight", (D, d), "linear", "linear")
        add(a + "kv_norm.weight", (D,), "bf16", "norm")
        add(a + "wo_a.weight", (G * dg, H * D // G), "linear", "linear")
        add(a + "wo_b.weight", (d, G * dg), "linear", "linear")
        if ratio > 0:
            coff = 2 if ratio == 4 else 1
            add(a + "compressor.ape", (ratio, coff * D), "fp32", "ape")
            add(a + "compressor.wkv.weight", (coff * D, d), "bf16", "linear")
            add(a + "compressor.wgate.weight", (coff * D, d), "bf16", "linear")
            add(a + "compressor.norm.weight", (D,), "bf16", "norm")
        if ratio == 4:
            add(a + "indexer.wq_b.weight", (nI * cI, dc), "linear", "linear")
            add(a + "indexer.weights_proj.weight", (nI, d), "bf16", "linear")
            add(a + "indexer.compressor.ape", (4, 2 * cI), "fp32", "ape")
            add(a + "indexer.compressor.wkv.weight", (2 * cI, d), "bf16", "linear")
            add(a + "indexer.compressor.wgate.weight", (2 * cI, d), "bf16", "linear")
            add(a + "indexer.compressor.norm.weight", (cI,), "bf16", "norm")
        f = p + "ffn."
        add(f + "gate.weight", (E, d), "bf16", "linear")
        if is_hash(layer_id):
            add(f + "gate.tid2eid", (V, K), "index", "tid2eid")
        else:
            add(f + "gate.bias", (E,), "fp32", "bias")
        for e in range(E):
            add(f + f"experts.{e}.w1.weight", (inter, d), "expert", "linear")
            add(f + f"experts.{e}.w2.weight", (d, inter), "expert", "linear")
            add(f + f"experts.{e}.w3.weight", (inter, d), "expert", "linear")
        add(f + "shared_experts.w1.weight", (inter, d), "linear", "linear")
        add(f + "shared_experts.w2.weight", (d, inter), "linear", "linear")
        add(f + "shared_experts.w3.weight", (inter, d), "linear", "linear")

    add("embed.weight", (V, d), "bf16", "embed")
    for i in range(n_layers):
        block(f"layers.{i}.", i, ratios[i])
    for j in range(n_mtp):
        p = f"mtp.{j}."
        block(p, n_layers + j, ratios[n_layers + j])
        add(p + "e_proj.weight", (d, d), "linear", "linear")
        add(p + "h_proj.weight", (d, d), "linear", "linear")
        add(p + "enorm.weight", (d,), "bf16", "norm")
        add(p + "hnorm.weight", (d,), "bf16", "norm")
        add(p + "norm.weight", (d,), "bf16", "norm")
        add(p + "hc_head_fn", (hc, hc * d), "fp32", "hc_fn")
        add(p + "hc_head_base", (hc,), "fp32", "hc_base")
        add(p + "hc_head_scale", (1,), "fp32", "hc_scale")
    add("norm.weight", (d,), "bf16", "norm")
    add("head.weight", (V, d), "bf16", "linear")
    add("hc_head_fn", (hc, hc * d), "fp32", "hc_fn")
    add("hc_head_base", (hc,), "fp32", "hc_base")
    add("hc_head_scale", (1,), "fp32", "hc_scale")
    return specs


def storage_kind(spec: TensorSpec, weights: str) -> str:
    """'fp8' | 'fp4' | 'bf16' | 'fp32' | 'int64': how a tensor is stored under a weights mode."""
    if spec.kind == "index":
        return "int64"
    if weights == "fp32":
        return "fp32"
    if spec.kind == "linear":
        return "bf16" if weights == "bf16" else "fp8"
    if spec.kind == "expert":
        return {"bf16": "bf16", "fp8": "fp8", "native": "fp4"}[weights]
    return spec.kind  # "bf16" / "fp32"
