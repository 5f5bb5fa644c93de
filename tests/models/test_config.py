"""DeepseekV4Config: presets, both key spellings, round trips, and errors that name the field."""

import json
import math

import pytest
import torch

from dsv4_ort.models import PRESETS, DeepseekV4Config, DeepseekV4ForCausalLM

FLASH_JSON = {  # the released DeepSeek-V4-Flash config.json
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0], "compress_rope_theta": 160000,
    "rope_theta": 10000, "max_position_embeddings": 1048576,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "num_hash_layers": 3,
    "swiglu_limit": 10.0, "hidden_act": "silu", "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "attention_bias": False,
    "attention_dropout": 0.0, "initializer_range": 0.02, "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True,
}


def test_released_flash_config_is_the_flash_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH_JSON))
    cfg = DeepseekV4Config.from_pretrained(tmp_path)
    assert cfg.replace(transformers_version=None) == DeepseekV4Config.from_preset("flash")
    assert len(cfg.compress_ratios) == 44 and cfg.mtp_ratios == [0]
    assert cfg.layer_ratios.count(4) == 21 and cfg.layer_ratios.count(128) == 20
    assert DeepseekV4Config.from_pretrained(tmp_path / "config.json") == cfg


def test_pro_preset():
    cfg = DeepseekV4Config.from_preset("pro")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.o_groups) == (7168, 61, 128, 16)
    assert cfg.layer_ratios.count(4) == 30 and cfg.layer_ratios.count(128) == 31 and cfg.layer_ratios[:2] == [128, 128]
    assert (cfg.index_topk, cfg.n_routed_experts, cfg.routed_scaling_factor) == (1024, 384, 2.5)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip(name, tmp_path):
    cfg = DeepseekV4Config.from_preset(name)
    assert DeepseekV4Config.from_dict(cfg.to_dict()) == cfg
    cfg.save_pretrained(tmp_path)
    assert DeepseekV4Config.from_pretrained(tmp_path) == cfg


def test_tiny_preset_covers_every_feature():
    cfg = DeepseekV4Config.from_preset("tiny")
    assert set(cfg.layer_ratios) == {0, 4, 128} and cfg.hc_mult == 4 and cfg.index_n_heads >= 8
    assert any(cfg.is_hash_layer(i) for i in range(cfg.num_hidden_layers))
    assert not all(cfg.is_hash_layer(i) for i in range(cfg.num_hidden_layers))
    assert cfg.sliding_window < 64 and cfg.index_topk < 64 // 4


def _native_bytes(cfg: DeepseekV4Config) -> int:
    """Bytes of the released storage formats: FP8 + 128x128 E8M0 scales for attention / shared-expert / MTP
    projections, FP4 + 1x32 scales for routed experts, bf16 for the rest of the matrices, fp32 vectors."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    fp8 = (".wq_a.", ".wq_b.", ".wkv.", ".wo_a.", ".wo_b.", "shared_experts.", "e_proj", "h_proj")
    total = 0
    for name, t in model.state_dict().items():
        n = t.numel()
        if ".experts." in name:
            total += n // 2 + n // 32
        elif any(k in name for k in fp8) and "compressor" not in name:
            total += n + math.ceil(t.shape[0] / 128) * math.ceil(t.shape[1] / 128)
        elif name.endswith("tid2eid"):
            total += 8 * n
        elif t.dim() == 2 and not name.endswith(("_fn", "ape")):
            total += 2 * n
        else:
            total += 4 * n
    return total


def test_bench_preset_shapes_and_size():
    cfg = DeepseekV4Config.from_preset("bench")
    assert (cfg.head_dim, cfg.qk_rope_head_dim, cfg.num_attention_heads) == (512, 64, 64)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.sliding_window) == (64, 128, 128)
    assert {0, 4, 128} <= set(cfg.layer_ratios)
    assert 1e9 <= _native_bytes(cfg) <= 4e9


def test_transformers_spelling():
    tiny = DeepseekV4Config.from_preset("tiny")
    hf = {**tiny.to_hf_dict(), "num_nextn_predict_layers": 1}
    assert DeepseekV4Config.from_dict(hf) == tiny
    # as written by transformers' own config class (bookkeeping keys included)
    import transformers
    d = transformers.DeepseekV4Config(**tiny.to_hf_dict()).to_dict()
    assert DeepseekV4Config.from_dict(d).replace(transformers_version=None) == tiny


def test_legacy_and_flat_variants():
    tiny = DeepseekV4Config.from_preset("tiny")
    d = tiny.to_hf_dict()
    d.pop("compress_rates")
    d["compress_rate_hca"] = 128
    d["rope_parameters"] = {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                            "beta_fast": 32, "beta_slow": 1, "rope_theta": 123.0}  # flat YaRN block
    d["compress_rope_theta"] = 160000.0
    assert "qk_rope_head_dim" not in d and d["partial_rotary_factor"] == 0.5  # gives 64
    cfg = DeepseekV4Config.from_dict({**d, "num_nextn_predict_layers": 1})
    assert cfg == tiny
    assert DeepseekV4Config.from_dict({**tiny.to_dict(), "rope_scaling": {"rope_type": "default"}}).rope_scaling is None
    # expert_dtype may live inside quantization_config
    q = {**tiny.to_dict(), "expert_dtype": None, "quantization_config": {"expert_dtype": "fp8"}}
    assert DeepseekV4Config.from_dict(q).expert_dtype == "fp8"


BAD = [
    ({"compress_ratios": [0, 4, 128, 4]}, "compress_ratios"),
    ({"compress_ratios": [0, 4, -1, 4, 0]}, "compress_ratios"),
    ({"num_hidden_layers": 5}, "compress_ratios"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"qk_rope_head_dim": 256}, "qk_rope_head_dim"),
    ({"o_groups": 3}, "o_groups"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_hash_layers": 5}, "num_hash_layers"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"expert_dtype": "int4"}, "expert_dtype"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
    ({"rope_scaling": {"type": "yarn", "factor": 16}}, "rope_scaling"),
    ({"rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                       "attention_factor": 1.277}}, "rope_scaling"),
    ({"layer_types": ["sliding_attention", "compressed_sparse_attention", "oops", "sliding_attention"]},
     "layer_types"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"mlp_layer_types": ["moe", "hash", "moe", "moe"]}, "mlp_layer_types"),
    ({"compress_rates": {"compressed_sparse_attention": 8}}, "compress_rates"),
    ({"no_such_key": 1}, "no_such_key"),
]


@pytest.mark.parametrize("change,field", BAD, ids=[f for _, f in BAD])
def test_errors_name_the_field(change, field):
    d = {**DeepseekV4Config.from_preset("tiny").to_dict(), **change}
    if "layer_types" in change:
        d.pop("compress_ratios")
    with pytest.raises(ValueError, match=field):
        DeepseekV4Config.from_dict(d)


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset"):
        DeepseekV4Config.from_preset("huge")


def test_any_mlp_layer_pattern_transformers_accepts():
    """Per-layer MLP kinds in any order (transformers' mlp_layer_types); a hash-first list folds into num_hash_layers."""
    from dsv4_ort.models import DeepseekV4Config

    base = DeepseekV4Config.from_preset("tiny").to_hf_dict()
    c = DeepseekV4Config.from_dict({**base, "mlp_layer_types": ["hash_moe", "moe", "moe", "hash_moe"]})
    assert [c.is_hash_layer(i) for i in range(4)] == [True, False, False, True] and c.num_hash_layers == 2
    assert c.to_hf_dict()["mlp_layer_types"] == ["hash_moe", "moe", "moe", "hash_moe"]
    assert DeepseekV4Config.from_dict(c.to_dict()) == c
    first = DeepseekV4Config.from_dict({**base, "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"]})
    assert first.mlp_layer_types is None and first.num_hash_layers == 1
    assert not any(c.is_hash_layer(c.num_hidden_layers + k) for k in range(c.num_nextn_predict_layers))
    for bad in (["hash_moe", "moe"], ["moe", "dense", "moe", "moe"]):
        with pytest.raises(ValueError, match="mlp_layer_types"):
            DeepseekV4Config.from_dict({**base, "mlp_layer_types": bad})
    with pytest.raises(ValueError, match="num_hash_layers"):
        DeepseekV4Config.from_dict({**base, "mlp_layer_types": ["moe", "hash_moe", "moe", "moe"], "num_hash_layers": 3})
