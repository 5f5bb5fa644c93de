"""DeepSeek-V4 model configuration.

`DeepseekV4Config` holds every field of the released ``config.json`` (DeepSeek-V4-Flash / -Pro) under
its HF key name, and normalises the two spellings found in the wild to one internal form:

* released / legacy keys: ``compress_ratios`` (one entry per main layer, then one per MTP layer),
  ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling`` (YaRN block), ``quantization_config``,
  ``expert_dtype``;
* transformers keys: ``layer_types`` + ``compress_rates`` (or ``compress_rate_csa`` /
  ``compress_rate_hca``), ``mlp_layer_types``, ``partial_rotary_factor``, ``rope_parameters``
  (``{"main": {...}, "compress": {...}}`` or a flat YaRN block).

Internal form: ``compress_ratios`` has ``num_hidden_layers + num_nextn_predict_layers`` entries
(0 = sliding window only, 4 = CSA: overlapping compressor + indexer, any other positive r = HCA-style
non-overlapping compressor), hash-routed MoE in layers ``< num_hash_layers``, RoPE on the last
``qk_rope_head_dim`` channels, ``rope_scaling`` either None or a YaRN dict used by compressed layers only.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

CSA_RATIO = 4  # the only ratio with overlapping windows and a lightning indexer

LAYER_TYPE_SLIDING = "sliding_attention"
LAYER_TYPE_CSA = "compressed_sparse_attention"
LAYER_TYPE_HCA = "heavily_compressed_attention"
MLP_HASH, MLP_SCORE = "hash_moe", "moe"

SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
EXPERT_DTYPES = (None, "fp4", "fp8", "bf16", "bfloat16")

# Bookkeeping keys written by transformers' `PretrainedConfig.to_dict()` (and similar tools); they carry
# nothing this model uses and are dropped on load.
_IGNORED_KEYS = frozenset({
    "_name_or_path", "chunk_size_feed_forward", "dtype", "id2label", "label2id", "is_encoder_decoder",
    "output_attentions", "output_hidden_states", "output_router_logits", "pad_token_id", "problem_type",
    "return_dict", "router_aux_loss_coef", "router_jitter_noise", "mlp_bias", "auto_map", "tokenizer_class",
})


def _flash_ratios(n_layers: int, n_mtp: int) -> list[int]:
    """Flash pattern: two SWA layers, then CSA at even / HCA at odd indices; MTP layers SWA."""
    return [0 if i < 2 else (CSA_RATIO if i % 2 == 0 else 128) for i in range(n_layers)] + [0] * n_mtp


def _default_yarn() -> dict:
    return {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}


def _default_quant() -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}


@dataclass
class DeepseekV4Config:
    """DeepSeek-V4 hyper-parameters; defaults are DeepSeek-V4-Flash.

    Field names are the keys of the released HF ``config.json``. See the module docstring for the
    accepted alternative spellings. Construction validates everything and raises ValueError naming the
    offending field.
    """

    vocab_size: int = 129280
    hidden_size: int = 4096  # d: width of one residual stream
    num_hidden_layers: int = 43  # main blocks, MTP excluded
    num_attention_heads: int = 64  # H
    num_key_value_heads: int = 1  # single shared K=V head
    head_dim: int = 512  # D
    qk_rope_head_dim: int = 64  # rd: RoPE on the last rd channels
    q_lora_rank: int = 1024  # d_c
    o_groups: int = 8  # G
    o_lora_rank: int = 1024  # d_g
    sliding_window: int = 128  # n_win, includes the current token
    compress_ratios: list[int] | None = None  # main layers then MTP layers; None = Flash pattern
    compress_rope_theta: float = 160000.0  # RoPE base of layers with ratio > 0 (with YaRN)
    rope_theta: float = 10000.0  # RoPE base of ratio-0 layers and MTP (plain)
    rope_scaling: dict | None = field(default_factory=_default_yarn)  # YaRN, compressed layers only
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    num_hash_layers: int = 3  # layers [0, num_hash_layers) route by tid2eid[token] (the released configs' spelling)
    # Per main layer "hash_moe" | "moe" in any order (transformers' spelling); None: hash-first from num_hash_layers.
    # A hash-first list is folded into num_hash_layers; otherwise num_hash_layers counts the hash layers.
    mlp_layer_types: list[str] | None = None
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    expert_dtype: str | None = "fp4"
    quantization_config: dict | None = field(default_factory=_default_quant)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    torch_dtype: str | None = "bfloat16"
    use_cache: bool = True
    model_type: str = "deepseek_v4"
    architectures: list[str] = field(default_factory=lambda: ["DeepseekV4ForCausalLM"])
    transformers_version: str | None = None

    def __post_init__(self):
        if self.compress_ratios is None:
            self.compress_ratios = _flash_ratios(self.num_hidden_layers, self.num_nextn_predict_layers)
        self.compress_ratios = [int(r) for r in self.compress_ratios]
        if self.architectures is None:
            self.architectures = ["DeepseekV4ForCausalLM"]
        if self.rope_scaling is not None:  # canonical form: {"type": "yarn", factor, original_..., beta_*}
            rs = dict(self.rope_scaling)
            kind = rs.pop("rope_type", None)
            rs["type"] = rs.get("type", kind)
            if rs.get("attention_factor") in (1, 1.0):
                rs.pop("attention_factor")
            self.rope_scaling = None if rs["type"] in ("default", None) else rs
        if self.mlp_layer_types is not None:
            types = [str(t) for t in self.mlp_layer_types]
            n_hash = sum(t == MLP_HASH for t in types)
            self.mlp_layer_types = None if types == [MLP_HASH] * n_hash + [MLP_SCORE] * (len(types) - n_hash) else types
            if self.mlp_layer_types is None:
                self.num_hash_layers = n_hash
        if isinstance(self.quantization_config, dict) and self.expert_dtype is None:
            self.expert_dtype = self.quantization_config.get("expert_dtype")
        self.validate()

    # ------------------------------------------------------------------------------ derived values

    @property
    def layer_ratios(self) -> list[int]:
        """Compress ratio of each main layer."""
        return self.compress_ratios[: self.num_hidden_layers]

    @property
    def mtp_ratios(self) -> list[int]:
        """Compress ratio of each MTP layer."""
        return self.compress_ratios[self.num_hidden_layers:]

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def is_hash_layer(self, layer_id: int) -> bool:
        """MoE of main layer `layer_id` routes by token id (MTP layers have ids >= num_hidden_layers)."""
        if self.mlp_layer_types is not None:
            return layer_id < self.num_hidden_layers and self.mlp_layer_types[layer_id] == MLP_HASH
        return layer_id < self.num_hash_layers

    # ------------------------------------------------------------------------------ validation

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""

        def need(ok: bool, name: str, msg: str):
            if not ok:
                raise ValueError(f"DeepseekV4Config.{name}: {msg} (got {getattr(self, name)!r})")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                     "max_position_embeddings", "index_n_heads", "index_head_dim", "index_topk",
                     "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult",
                     "hc_sinkhorn_iters"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "must be a positive integer")
        for name in ("num_nextn_predict_layers", "num_hash_layers"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 0, name, "must be a non-negative integer")
        need(self.num_key_value_heads == 1, "num_key_value_heads", "DeepSeek-V4 uses one shared K=V head")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even (interleaved pairs)")
        need(self.qk_rope_head_dim <= self.head_dim, "qk_rope_head_dim", f"must be <= head_dim={self.head_dim}")
        need(self.qk_rope_head_dim <= self.index_head_dim, "qk_rope_head_dim",
             f"must be <= index_head_dim={self.index_head_dim}")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups",
             f"must divide num_attention_heads={self.num_attention_heads}")
        n_total = self.num_hidden_layers + self.num_nextn_predict_layers
        need(len(self.compress_ratios) == n_total, "compress_ratios",
             f"needs num_hidden_layers + num_nextn_predict_layers = {n_total} entries, "
             f"has {len(self.compress_ratios)}")
        need(all(r >= 0 for r in self.compress_ratios), "compress_ratios", "entries must be >= 0")
        need(self.num_hash_layers <= self.num_hidden_layers, "num_hash_layers",
             f"must be <= num_hidden_layers={self.num_hidden_layers}")
        if self.mlp_layer_types is not None:
            types = self.mlp_layer_types
            need(len(types) == self.num_hidden_layers and all(t in (MLP_HASH, MLP_SCORE) for t in types),
                 "mlp_layer_types", f"needs num_hidden_layers={self.num_hidden_layers} entries of "
                 f"{MLP_HASH!r} / {MLP_SCORE!r}")
            need(self.num_hash_layers == types.count(MLP_HASH), "num_hash_layers",
                 f"disagrees with mlp_layer_types ({types.count(MLP_HASH)} {MLP_HASH!r} layers)")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"must be <= n_routed_experts={self.n_routed_experts}")
        need(self.n_shared_experts == 1, "n_shared_experts", "DeepSeek-V4 has exactly one shared expert")
        need(self.scoring_func in SCORING_FUNCS, "scoring_func", f"must be one of {SCORING_FUNCS}")
        need(self.topk_method in ("noaux_tc", None), "topk_method", "only 'noaux_tc' is defined")
        need(self.hidden_act == "silu", "hidden_act", "only 'silu' (SwiGLU) is defined")
        need(self.expert_dtype in EXPERT_DTYPES, "expert_dtype", f"must be one of {EXPERT_DTYPES}")
        need(self.tie_word_embeddings is False, "tie_word_embeddings", "embedding and head are separate")
        need(self.swiglu_limit > 0, "swiglu_limit", "must be > 0")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
            need(float(getattr(self, name)) > 0, name, "must be > 0")
        rs = self.rope_scaling
        if rs is not None:
            need(rs.get("type") == "yarn", "rope_scaling", "only YaRN scaling is defined")
            for key in ("factor", "original_max_position_embeddings"):
                need(key in rs and float(rs[key]) > 0, "rope_scaling", f"YaRN needs a positive '{key}'")
            need("attention_factor" not in rs, "rope_scaling",
                 "DeepSeek-V4 applies no YaRN attention factor (attention_factor must be 1.0 or absent)")

    # ------------------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV4Config":
        """Build from a released or transformers-style dict (see the module docstring)."""
        d = copy.deepcopy(dict(d))
        for k in list(d):
            if k in _IGNORED_KEYS or k.startswith("_"):
                d.pop(k)
        n = d.get("num_hidden_layers", cls.num_hidden_layers)
        n_mtp = d.get("num_nextn_predict_layers", cls.num_nextn_predict_layers)

        # attention schedule
        layer_types = d.pop("layer_types", None)
        rates = dict(d.pop("compress_rates", None) or {LAYER_TYPE_CSA: CSA_RATIO, LAYER_TYPE_HCA: 128})
        for legacy, kind in (("compress_rate_csa", LAYER_TYPE_CSA), ("compress_rate_hca", LAYER_TYPE_HCA)):
            if legacy in d:
                rates[kind] = d.pop(legacy)
        if rates.get(LAYER_TYPE_CSA, CSA_RATIO) != CSA_RATIO:
            raise ValueError(f"DeepseekV4Config.compress_rates: '{LAYER_TYPE_CSA}' must be {CSA_RATIO} "
                             f"(got {rates[LAYER_TYPE_CSA]!r})")
        if layer_types is not None:
            rates[LAYER_TYPE_SLIDING] = 0
            bad = [t for t in layer_types if t not in rates]
            if bad:
                raise ValueError(f"DeepseekV4Config.layer_types: unknown layer type(s) {bad}")
            if len(layer_types) != n:
                raise ValueError(f"DeepseekV4Config.layer_types: needs num_hidden_layers={n} entries, "
                                 f"has {len(layer_types)}")
            from_types = [int(rates[t]) for t in layer_types]
            if d.get("compress_ratios") is None:
                d["compress_ratios"] = from_types + [0] * n_mtp
            elif list(d["compress_ratios"])[:n] != from_types:
                raise ValueError("DeepseekV4Config.compress_ratios: disagrees with layer_types")

        # MoE schedule
        mlp_types = d.pop("mlp_layer_types", None)
        if mlp_types is not None:  # any order transformers accepts; __post_init__ folds a hash-first list
            if not isinstance(mlp_types, (list, tuple)) or len(mlp_types) != n or \
                    any(t not in (MLP_HASH, MLP_SCORE) for t in mlp_types):
                raise ValueError(f"DeepseekV4Config.mlp_layer_types: must be {n} entries of {MLP_HASH!r} / "
                                 f"{MLP_SCORE!r} (got {mlp_types})")
            n_hash = sum(t == MLP_HASH for t in mlp_types)
            if d.setdefault("num_hash_layers", n_hash) != n_hash:
                raise ValueError("DeepseekV4Config.num_hash_layers: disagrees with mlp_layer_types")
            d["mlp_layer_types"] = list(mlp_types)

        # RoPE
        prf = d.pop("partial_rotary_factor", None)
        if prf is not None and "qk_rope_head_dim" not in d:
            d["qk_rope_head_dim"] = int(round(d.get("head_dim", cls.head_dim) * prf))
        rp = d.pop("rope_parameters", None)
        if rp:
            if isinstance(rp.get("main"), dict) or isinstance(rp.get("compress"), dict):
                main, comp = rp.get("main") or {}, dict(rp.get("compress") or {})
                if main.get("rope_type", "default") != "default":
                    raise ValueError("DeepseekV4Config.rope_parameters: 'main' must be plain RoPE")
                if "rope_theta" in main:
                    d["rope_theta"] = main["rope_theta"]
                if "rope_theta" in comp:
                    d["compress_rope_theta"] = comp["rope_theta"]
            else:  # flat YaRN block: applies to the compressed layers, whose base is compress_rope_theta
                comp = dict(rp)
            comp.pop("rope_theta", None)
            comp.pop("partial_rotary_factor", None)
            kind = comp.get("rope_type", comp.get("type", "default"))
            if "rope_scaling" not in d:
                d["rope_scaling"] = None if kind == "default" else comp

        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"DeepseekV4Config: unknown field(s) {unknown}")
        return cls(**d)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "DeepseekV4Config":
        """Read ``config.json`` from a model directory (or the file itself)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_preset(cls, name: str) -> "DeepseekV4Config":
        """One of :data:`PRESETS`: ``flash``, ``pro`` (released shapes), ``tiny`` (tests), ``bench``, ``demo`` (tiny
        with the released vocabulary)."""
        if name not in PRESETS:
            raise ValueError(f"DeepseekV4Config.from_preset: unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return cls.from_dict(PRESETS[name])

    def replace(self, **changes) -> "DeepseekV4Config":
        """A validated copy with some fields changed."""
        return self.from_dict({**self.to_dict(), **changes})

    # ------------------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """Released-style dict (legacy keys); ``from_dict(to_dict())`` round-trips."""
        return copy.deepcopy(dataclasses.asdict(self))

    def save_pretrained(self, path: str | os.PathLike) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.DeepseekV4Config`` (main layers only; HF has no MTP).

        Every non-zero ratio other than 4 must be the same value (HF has one HCA rate).
        """
        hca = sorted({r for r in self.layer_ratios if r not in (0, CSA_RATIO)})
        if len(hca) > 1:
            raise ValueError(f"DeepseekV4Config.compress_ratios: transformers supports one HCA ratio, got {hca}")
        kinds = {0: LAYER_TYPE_SLIDING, CSA_RATIO: LAYER_TYPE_CSA}
        d = self.to_dict()
        for k in ("compress_ratios", "num_hash_layers", "mlp_layer_types", "qk_rope_head_dim", "rope_scaling", "topk_method",
                  "expert_dtype", "quantization_config", "torch_dtype", "architectures", "model_type",
                  "transformers_version", "compress_rope_theta", "rope_theta"):
            d.pop(k)
        d["layer_types"] = [kinds.get(r, LAYER_TYPE_HCA) for r in self.layer_ratios]
        d["compress_rates"] = {LAYER_TYPE_CSA: CSA_RATIO, LAYER_TYPE_HCA: hca[0] if hca else 128}
        d["mlp_layer_types"] = [MLP_HASH if self.is_hash_layer(i) else MLP_SCORE for i in range(self.num_hidden_layers)]
        d["partial_rotary_factor"] = self.qk_rope_head_dim / self.head_dim
        comp = {"rope_type": "default"}
        if self.rope_scaling is not None and self.rope_scaling.get("type") == "yarn":
            rs = self.rope_scaling
            comp = {"rope_type": "yarn", "factor": rs["factor"], "attention_factor": 1.0,
                    "original_max_position_embeddings": rs["original_max_position_embeddings"],
                    "beta_fast": rs.get("beta_fast", 32), "beta_slow": rs.get("beta_slow", 1)}
        d["rope_parameters"] = {
            "main": {"rope_type": "default", "rope_theta": self.rope_theta,
                     "partial_rotary_factor": d["partial_rotary_factor"]},
            "compress": {**comp, "rope_theta": self.compress_rope_theta,
                         "partial_rotary_factor": d["partial_rotary_factor"]},
        }
        return d


# ---------------------------------------------------------------------------------------------- presets

_FLASH: dict[str, Any] = {}  # dataclass defaults are Flash

_PRO: dict[str, Any] = {
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
    "o_groups": 16, "index_topk": 1024, "n_routed_experts": 384, "moe_intermediate_size": 3072,
    "routed_scaling_factor": 2.5, "compress_ratios": [128, 128] + [4, 128] * 29 + [4] + [0],
}

# Every feature at toy size: layer 0 SWA + hash MoE, 1 CSA + hash MoE, 2 HCA (r=128) + score MoE,
# 3 CSA + score MoE, MTP SWA + score MoE. Window 16 and index_topk 8 are exceeded by sequences of a
# few dozen tokens; HCA emits its first entry at token 128 (use >= 264 tokens to see two).
# YaRN with original length 64 interpolates most rope pairs.
_TINY: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 64, "o_groups": 4, "o_lora_rank": 32,
    "sliding_window": 16, "compress_ratios": [0, 4, 128, 4, 0],
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1024, "index_n_heads": 8, "index_head_dim": 128, "index_topk": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "num_hash_layers": 2,
}

# Real per-head geometry (head_dim 512, rope 64, 64 heads, indexer 64 x 128, window 128, ratios 4/128)
# with a narrow residual stream. Native size ~2.1 GB: FP8 linears ~0.33 GB, FP4 experts ~0.7 GB,
# bf16 embedding + head ~1.06 GB.
_BENCH: dict[str, Any] = {
    "hidden_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 64, "q_lora_rank": 512,
    "o_groups": 8, "o_lora_rank": 256, "compress_ratios": [0, 4, 128, 4, 128, 4, 0], "num_hash_layers": 2,
    "n_routed_experts": 32, "num_experts_per_tok": 6, "moe_intermediate_size": 1024,
    "max_position_embeddings": 65536,
}

# The built-in demo model of `dsv4-ort run`: the tiny geometry with the released vocabulary (129280), so that its
# export carries DeepSeek-V4's tokenizer and the demo prints text (random weights: the text is noise).
_DEMO: dict[str, Any] = {**_TINY, "vocab_size": 129280}

PRESETS: dict[str, dict[str, Any]] = {"flash": _FLASH, "pro": _PRO, "tiny": _TINY, "bench": _BENCH, "demo": _DEMO}
