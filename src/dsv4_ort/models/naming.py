"""Tensor namings of DeepSeek-V4 checkpoints and the maps between them.

Three layouts are understood (:data:`NAMINGS`), told apart by their tensor names (:func:`detect_naming`):

* ``"deepseek"`` - the released layout (``embed.weight``, ``layers.N.attn.wq_a.weight`` + ``layers.N.attn.wq_a.scale``,
  ``layers.N.ffn.experts.E.w1.weight``, ``mtp.0.*``, ...), also the state-dict naming of
  :class:`dsv4_ort.models.model.DeepseekV4ForCausalLM` (minus the ``.scale`` tensors);
* ``"transformers"`` - what transformers' ``save_pretrained`` writes: its conversion mapping applied in reverse, i.e.
  the released names under ``model.`` (``model.embed_tokens.weight``, ``head.weight``, ``model.hc_head.hc_fn``), the
  attention's kv norm spelled ``attn.norm``, experts per expert, and no ``mtp.*`` tensor (transformers builds no MTP);
* ``"hf"`` - the module names of transformers' ``DeepseekV4ForCausalLM`` in memory
  (``model.layers.N.self_attn.q_a_proj.weight``, fused ``model.layers.N.mlp.experts.gate_up_proj`` ``[E, 2I, d]`` =
  per expert ``cat(w1, w3)`` and ``down_proj`` ``[E, d, I]`` = per expert ``w2``). No tensor is transposed. MTP
  tensors keep their DeepSeek names (``mtp.0.*``). Block scales are ``<weight>_scale_inv``.

Quantised checkpoints in the ``"hf"`` naming store the fused expert tensors quantised as a whole (``gate_up_proj`` +
``gate_up_proj_scale_inv``; FP4: int8 ``[E, 2I, d/2]`` + E8M0 ``[E, 2I, d/32]``), exactly the parameters of
transformers' ``FP8Experts``; with FP8 experts this needs ``moe_intermediate_size % 128 == 0`` so that no 128-row
scale block straddles gate and up. transformers reads that layout only into its FP8 modules (a CUDA / XPU device);
its dequantising CPU load decodes ``X.weight`` + ``X.weight_scale_inv`` pairs and per-expert names, so write a
quantised checkpoint meant for transformers on a CPU with ``naming="deepseek"``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

import torch

from .errors import MissingTensorError, UnexpectedTensorError

__all__ = [
    "NAMINGS", "HFSlot", "deepseek_to_hf", "hf_to_deepseek", "scale_name", "hf_state_dict_to_deepseek",
    "deepseek_state_dict_to_hf", "saved_to_deepseek", "deepseek_to_saved", "detect_naming"
]


# per-layer renames: DeepSeek suffix (after "layers.N.") -> HF suffix (after "model.layers.N.")
_LAYER_RENAMES: tuple[tuple[str, str], ...] = (
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
)
_TOP_RENAMES: tuple[tuple[str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
)
_LAYER_DS2HF = dict(_LAYER_RENAMES)
_LAYER_HF2DS = {v: k for k, v in _LAYER_RENAMES}
_TOP_DS2HF = dict(_TOP_RENAMES)
_TOP_HF2DS = {v: k for k, v in _TOP_RENAMES}
_EXPERT_PARTS = {"w1": ("gate_up_proj", "gate"), "w3": ("gate_up_proj", "up"), "w2": ("down_proj", None)}

_DS_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_DS_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$")


class HFSlot(NamedTuple):
    """Where a DeepSeek tensor lives in the transformers naming.

    ``expert`` is the index along dim 0 of a fused expert tensor; ``part`` is ``"gate"`` (rows
    ``[:I]`` of ``gate_up_proj``), ``"up"`` (rows ``[I:]``) or None (the whole per-expert slice,
    or a plain 1:1 tensor when ``expert`` is None too).
    """

    name: str
    expert: int | None = None
    part: str | None = None


def deepseek_to_hf(name: str) -> HFSlot:
    """Map a DeepSeek tensor name (weights, ``.scale`` block scales, buffers) to its HF slot.

    ``mtp.*`` names map to themselves (transformers has no MTP module and ignores them).
    Raises :class:`UnexpectedTensorError` for names outside the DeepSeek-V4 inventory.
    """
    if name.startswith("mtp."):
        return HFSlot(name)
    m = _DS_EXPERT_RE.match(name)
    if m:
        layer, expert, w, kind = m.groups()
        fused, part = _EXPERT_PARTS[w]
        suffix = "_scale_inv" if kind == "scale" else ""
        return HFSlot(f"model.layers.{layer}.mlp.experts.{fused}{suffix}", int(expert), part)
    is_scale = name.endswith(".scale") and not name.endswith("_scale")
    base = name[: -len(".scale")] + ".weight" if is_scale else name
    out = None
    if base in _TOP_DS2HF:
        out = _TOP_DS2HF[base]
    else:
        m = _DS_LAYER_RE.match(base)
        if m and m.group(2) in _LAYER_DS2HF:
            out = f"model.layers.{m.group(1)}.{_LAYER_DS2HF[m.group(2)]}"
    if out is None or (is_scale and not out.endswith(".weight")):
        raise UnexpectedTensorError("not a DeepSeek-V4 tensor name", tensor=name)
    return HFSlot(out + "_scale_inv" if is_scale else out)


def hf_to_deepseek(name: str, n_experts: int | None = None) -> list[str]:
    """Map an HF tensor name to the DeepSeek name(s) it holds.

    1:1 names give a one-element list. Fused expert tensors give, expert-major,
    ``[experts.0.w1, experts.0.w3, experts.1.w1, ...]`` for ``gate_up_proj`` and
    ``[experts.0.w2, ...]`` for ``down_proj`` (``.scale`` names for ``*_scale_inv``);
    ``n_experts`` is required for them.
    """
    if name.startswith("mtp."):
        return [name]
    m = HF_EXPERT_RE.match(name)
    if m:
        layer, fused, sc = m.groups()
        if n_experts is None:
            raise ValueError(f"hf_to_deepseek: n_experts is needed to expand the fused tensor {name!r}")
        kind = "scale" if sc else "weight"
        ws = ("w1", "w3") if fused == "gate_up_proj" else ("w2",)
        return [f"layers.{layer}.ffn.experts.{e}.{w}.{kind}" for e in range(n_experts) for w in ws]
    is_scale = name.endswith(".weight_scale_inv") or name.endswith(".weight_scale")
    base = name.rsplit(".", 1)[0] + ".weight" if is_scale else name
    out = None
    if base in _TOP_HF2DS:
        out = _TOP_HF2DS[base]
    else:
        m = _HF_LAYER_RE.match(base)
        if m and m.group(2) in _LAYER_HF2DS:
            out = f"layers.{m.group(1)}.{_LAYER_HF2DS[m.group(2)]}"
    if out is None:
        raise UnexpectedTensorError("not a transformers DeepSeek-V4 tensor name", tensor=name)
    return [out[: -len(".weight")] + ".scale" if is_scale else out]


def scale_name(weight_name: str, naming: str = "deepseek") -> str:
    """Name of the block-scale tensor of a quantised weight in the given naming."""
    if naming == "deepseek":
        if not weight_name.endswith(".weight"):
            raise ValueError(f"{weight_name!r} is not a weight name")
        return weight_name[: -len(".weight")] + ".scale"
    return weight_name + "_scale_inv"


def _hf_expert_slice(t: torch.Tensor, part: str | None) -> torch.Tensor:
    if part is None:
        return t
    half = t.shape[0] // 2
    return t[:half] if part == "gate" else t[half:]


def hf_state_dict_to_deepseek(
    state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Convert a (dense) transformers state dict to DeepSeek names, splitting fused experts.

    Floating tensors are cast to ``dtype`` when given. Non-persistent / unknown HF buffers raise
    :class:`UnexpectedTensorError`; pass ``model.state_dict()`` (persistent entries only).
    """
    out: dict[str, torch.Tensor] = {}
    for hf_name, t in state_dict.items():
        m = HF_EXPERT_RE.match(hf_name)
        if m:
            if m.group(3):
                raise UnexpectedTensorError("quantised fused experts are not a dense state dict", tensor=hf_name)
            names = hf_to_deepseek(hf_name, t.shape[0])
            if m.group(2) == "gate_up_proj":
                for e in range(t.shape[0]):
                    out[names[2 * e]] = _hf_expert_slice(t[e], "gate")
                    out[names[2 * e + 1]] = _hf_expert_slice(t[e], "up")
            else:
                for e in range(t.shape[0]):
                    out[names[e]] = t[e]
        else:
            (name,) = hf_to_deepseek(hf_name)
            out[name] = t
    if dtype is not None:
        out = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in out.items()}
    return out


def deepseek_state_dict_to_hf(
    state_dict: dict[str, torch.Tensor], include_mtp: bool = False
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_state_dict_to_deepseek` (dense tensors): fuses per-expert w1/w3/w2.

    ``mtp.*`` entries are dropped unless ``include_mtp`` (transformers has no MTP module).
    """
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, dict[str | None, torch.Tensor]]] = {}
    for name, t in state_dict.items():
        if name.startswith("mtp.") and not include_mtp:
            continue
        slot = deepseek_to_hf(name)
        if slot.expert is None:
            out[slot.name] = t
        else:
            fused.setdefault(slot.name, {}).setdefault(slot.expert, {})[slot.part] = t
    for hf_name, experts in fused.items():
        n = max(experts) + 1
        if sorted(experts) != list(range(n)):
            raise MissingTensorError(f"experts {sorted(set(range(n)) - set(experts))} missing for", tensor=hf_name)
        rows = []
        for e in range(n):
            parts = experts[e]
            if hf_name.endswith("gate_up_proj"):
                if set(parts) != {"gate", "up"}:
                    raise MissingTensorError(f"expert {e} lacks w1 or w3", tensor=hf_name)
                rows.append(torch.cat([parts["gate"], parts["up"]], dim=0))
            else:
                rows.append(parts[None])
        out[hf_name] = torch.stack(rows)
    return out


# The layout ``save_pretrained`` writes: transformers applies its conversion mapping in reverse, so the file holds the
# released names under a ``model.`` prefix with a few leaves of its own (the attention's kv norm is ``attn.norm``, the
# compressors' norms keep ``norm``); experts are split per expert again. ``head.weight`` stays unprefixed.
_SAVED_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "head.weight": "head.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_SAVED_TOP_INV = {v: k for k, v in _SAVED_TOP.items()}
_SAVED_LEAVES = (("attn.norm.weight", "attn.kv_norm.weight"),)  # saved suffix -> released suffix
_SAVED_LEAF = dict(_SAVED_LEAVES)
_SAVED_LEAF_INV = {v: k for k, v in _SAVED_LEAVES}

# Layout name -> how a reader recognises it (listed in the error for an unrecognised tensor).
NAMINGS = {
    "deepseek": "the released layout (embed.weight, layers.N.attn.wq_a.weight + .scale, layers.N.ffn.experts.E.w1, "
                "mtp.0.*)",
    "transformers": "what transformers' save_pretrained writes (model.embed_tokens.weight, head.weight, "
                    "model.layers.N.attn.wq_a.weight, model.layers.N.attn.norm.weight, model.hc_head.hc_fn)",
    "hf": "transformers' in-memory module names (model.layers.N.self_attn.q_a_proj.weight, fused "
          "mlp.experts.gate_up_proj, lm_head.weight)",
}
_HF_MARK_RE = re.compile(r"^(lm_head\.|model\.layers\.\d+\.(self_attn|mlp|input_layernorm|post_attention_layernorm|"
                         r"attn_hc|ffn_hc)\.)")
_SAVED_MARK_RE = re.compile(r"^model\.layers\.\d+\.(attn\.|ffn\.|attn_norm\.|ffn_norm\.|hc_attn_|hc_ffn_)")


def saved_to_deepseek(name: str) -> str:
    """Map a tensor name of the ``"transformers"`` (``save_pretrained``) layout to the released name.

    Block scales keep the spelling transformers gives them (``.scale``, ``.weight_scale_inv``) and pair with their
    weight by that spelling; the one renamed leaf (the kv norm) is never quantised. Raises
    :class:`UnexpectedTensorError` for names outside the layout.
    """
    if name.startswith("mtp."):
        return name
    if name in _SAVED_TOP:
        return _SAVED_TOP[name]
    m = _HF_LAYER_RE.match(name)
    if m is None:
        raise UnexpectedTensorError("not a tensor name of transformers' save_pretrained layout", tensor=name)
    layer, rest = m.groups()
    return f"layers.{layer}.{_SAVED_LEAF.get(rest, rest)}"


def deepseek_to_saved(name: str) -> str:
    """Inverse of :func:`saved_to_deepseek` for weights and buffers (``mtp.*`` names are kept)."""
    if name.startswith("mtp."):
        return name
    if name in _SAVED_TOP_INV:
        return _SAVED_TOP_INV[name]
    m = _DS_LAYER_RE.match(name)
    if m is None:
        raise UnexpectedTensorError("not a DeepSeek-V4 tensor name", tensor=name)
    return f"model.layers.{m.group(1)}.{_SAVED_LEAF_INV.get(m.group(2), m.group(2))}"


def detect_naming(names: Iterable[str]) -> str:
    """The layout of a checkpoint, recognised by its tensor names (one of :data:`NAMINGS`).

    ``"hf"``: any transformers module name (``self_attn``, ``mlp``, ``lm_head``); ``"transformers"``: released leaves
    under ``model.``; else ``"deepseek"``. A checkpoint mixing the two transformers layouts is an error naming a
    tensor of each.
    """
    hf = saved = None
    for n in names:
        if hf is None and _HF_MARK_RE.match(n):
            hf = n
        elif saved is None and _SAVED_MARK_RE.match(n):
            saved = n
    if hf is not None and saved is not None:
        raise UnexpectedTensorError(f"checkpoint mixes two layouts (also has {saved!r} of the 'transformers' layout)",
                                    tensor=hf)
    if hf is not None:
        return "hf"
    return "transformers" if saved is not None else "deepseek"


def unknown_name_error(name: str, naming: str, file: str) -> UnexpectedTensorError:
    known = "; ".join(f"{k!r}: {v}" for k, v in NAMINGS.items())
    return UnexpectedTensorError(f"not a DeepSeek-V4 tensor name of the {naming!r} layout (layouts known: {known})",
                                 tensor=name, file=file)
