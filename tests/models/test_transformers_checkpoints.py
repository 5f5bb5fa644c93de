"""Checkpoints written by transformers itself load, export and run like transformers runs them.

transformers' ``save_pretrained`` writes its own layout (the released names under ``model.``, the attention's kv norm
as ``attn.norm``, experts split per expert, no MTP tensors although the config says ``num_nextn_predict_layers: 1``).
Each case draws a transformers model, saves it (fp32 or bf16, one file or shards with an index), and checks, against
transformers' own ``from_pretrained`` of that directory (eager, float32, CPU):

* the reference (:func:`dsv4_ort.models.load_model`): logits within 1e-4 of max|logit|, equal greedy continuation;
* the export in onnxruntime at every ISA level: logits within 1e-3, equal greedy continuation.

The configs include MLP patterns that are not hash-first and attention patterns that are not the release's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from reference_helpers import hf_step, randomize_hf, selection_margin

from dsv4_ort.export import export_model
from dsv4_ort.models import DeepseekV4Config, load_model
from dsv4_ort.models.checkpoint import Checkpoint
from dsv4_ort.runtime import Session

transformers.logging.set_verbosity_error()

REF_TOL, ORT_TOL = 1e-4, 1e-3  # max|diff| / max|logit|
PROMPT, GREEDY = 48, 12

TINY = DeepseekV4Config.from_preset("tiny")
CASES = {
    # the preset as transformers saves it, one float32 file
    "tiny_fp32": (TINY, torch.float32, {}),
    # bf16 weights in shards with model.safetensors.index.json
    "tiny_bf16_sharded": (TINY, torch.bfloat16, {"max_shard_size": "400KB"}),
    # a hash layer that is not first (rejected before: "'hash_moe' layers first then 'moe'")
    "hash_last": (TINY.replace(mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"]), torch.float32, {}),
    # alternating MLP kinds over an attention pattern of its own (CSA first, two sliding layers, HCA last)
    "alternating": (TINY.replace(num_hidden_layers=5, compress_ratios=[4, 0, 0, 4, 128, 0], num_hash_layers=2,
                                 mlp_layer_types=["moe", "hash_moe", "moe", "hash_moe", "moe"]),
                    torch.float32, {"max_shard_size": "1MB"}),
}


def _greedy(step, logits, n):
    out = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits = step(out[-1])
    return out


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    """(case name, config, directory written by save_pretrained, transformers' model loaded back from it)."""
    config, dtype, kwargs = CASES[request.param]
    hc = transformers.DeepseekV4Config(**config.to_hf_dict())
    hf = transformers.DeepseekV4ForCausalLM(hc).eval()
    randomize_hf(hf, seed=3)
    path = tmp_path_factory.mktemp(request.param)
    hf.to(dtype).save_pretrained(path, **kwargs)
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                attn_implementation="eager").eval()
    return request.param, config, path, oracle


def _prompt(config):
    return torch.randint(0, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def _oracle_run(oracle, ids):
    cache = transformers.DynamicCache(config=oracle.config)
    logits = hf_step(oracle, ids, cache)
    toks = _greedy(lambda t: hf_step(oracle, torch.tensor([[t]]), cache), logits, GREEDY)
    return logits, toks


def test_layout_is_transformers_own(saved):
    """What the test loads is transformers' save_pretrained layout, detected by content (not our own writer)."""
    name, config, path, _ = saved
    ck = Checkpoint(path)
    assert ck.naming == "transformers"
    assert not ck.has_mtp and json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert "model.layers.0.attn.norm.weight" in ck.weight_map and "head.weight" in ck.weight_map
    assert (path / "model.safetensors.index.json").exists() == ("sharded" in name or name == "alternating")


@torch.no_grad()
def test_reference_matches_transformers(saved):
    name, config, path, oracle = saved
    ours = load_model(path)
    assert len(ours.mtp) == 0  # no MTP tensors: MTP absent, as transformers builds it
    assert [ours.config.is_hash_layer(i) for i in range(config.num_hidden_layers)] == \
        [t == "hash_moe" for t in oracle.config.mlp_layer_types]
    ids = _prompt(config)
    assert selection_margin(ours, ids) > 1e-5, "test inputs within rounding of a top-k tie: choose another seed"
    ref, ref_toks = _oracle_run(oracle, ids)
    got = ours(ids)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err <= REF_TOL, (name, err)
    state = ours.new_state(1, PROMPT + GREEDY + 1)
    toks = _greedy(lambda t: ours(torch.tensor([[t]]), state=state), ours(ids, state=state), GREEDY)
    assert toks == ref_toks


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    name, config, path, oracle = saved
    out = tmp_path_factory.mktemp(name + "_onnx")
    export_model(path, out, max_seq_len=128, logits="all", progress=False)
    return out, _oracle_run(oracle, _prompt(config))


def test_export_runs_like_transformers(saved, exported, isa):
    name, config, _, _ = saved
    out, (ref, ref_toks) = exported
    meta = json.loads((out / "dsv4_ort.json").read_text())
    assert meta["mtp"] == {"exported": False, "layers": 1, "in_checkpoint": False}
    assert meta["source"]["naming"] == "transformers"
    sess = Session(out, isa=isa, intra_op_threads=1)
    ids = _prompt(config).numpy()
    state = sess.new_state(1)
    got = sess.forward(ids, state)
    err = float(np.abs(got - ref.numpy()).max() / np.abs(ref.numpy()).max())
    assert err <= ORT_TOL, (name, isa, err)
    toks = _greedy(lambda t: sess.forward(np.array([[t]], np.int64), state), got, GREEDY)
    assert toks == ref_toks, (name, isa)


def test_unrecognised_layout_names_tensor_and_layouts(tmp_path):
    from safetensors.torch import save_file

    from dsv4_ort.models import UnexpectedTensorError, write_random_checkpoint

    ck = tmp_path / "ck"
    write_random_checkpoint(ck, TINY, naming="deepseek", seed=0)
    save_file({"decoder.blocks.0.attention.query.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((ck / "config.json").read_text())
    with pytest.raises(UnexpectedTensorError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert "decoder.blocks.0.attention.query.weight" in msg and all(f"'{k}'" in msg for k in
                                                                     ("deepseek", "transformers", "hf"))


@pytest.mark.parametrize("weights", ["fp8", "native"])
def test_quantised_tensors_in_the_saved_layout(tmp_path, weights):
    """FP8 / FP4 weights under the saved layout's names (scales as ``.weight_scale_inv``, the spelling transformers
    gives a quantised module's scale) read exactly like the released layout."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dsv4_ort.models import deepseek_to_saved, iter_checkpoint, write_random_checkpoint

    ds = tmp_path / "ds"
    write_random_checkpoint(ds, TINY, naming="deepseek", weights=weights, seed=1)
    saved = tmp_path / "saved"
    saved.mkdir()
    tensors = {}
    for f in sorted(ds.glob("*.safetensors")):
        with safe_open(str(f), "pt") as g:
            for k in g.keys():
                if k.endswith(".scale"):
                    new = deepseek_to_saved(k[: -len(".scale")] + ".weight") + "_scale_inv"
                else:
                    new = deepseek_to_saved(k)
                tensors[new] = g.get_tensor(k)
    assert any(k.endswith("_scale_inv") for k in tensors)
    save_file(tensors, str(saved / "model.safetensors"))
    (saved / "config.json").write_text((ds / "config.json").read_text())
    assert Checkpoint(saved).naming == "transformers"
    a = dict(iter_checkpoint(ds))
    b = dict(iter_checkpoint(saved))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
