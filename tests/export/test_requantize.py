"""Export options --head / --dense: the LM head and the dense projections requantised to FP8 or FP4.

The check is exact in intent: a checkpoint whose covered tensors hold their requantised values (dequantised, exact
in bf16) exported natively must give the same logits as the original checkpoint exported with the option, at every
ISA level, and both must match the PyTorch reference of that checkpoint."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_fixtures import REL_TOL, config, random_ids, reference_logits, rel_err, require_library
from testutil import available_isa_levels

from dsv4_ort.export import ExportError, export_model
from dsv4_ort.export.exporter import _requant_group
from dsv4_ort.export.weights import WeightFormatError, convert, requantize
from dsv4_ort.models import quant_np as QN
from dsv4_ort.runtime import Session

OPTION = {"head": "fp8", "dense": "fp4"}


def _dequantised(x: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "fp8":
        return QN.dequant_fp8_block(*QN.quant_fp8_block(x))
    return QN.dequant_fp4(*QN.quant_fp4(x))


def _write_requantised_copy(src, dst, option: dict) -> list:
    """dst = src with every tensor the option covers replaced by its requantised value, stored bf16 (exact)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    changed = []
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
            continue
        tensors = load_file(str(f))
        for name, t in tensors.items():
            fmt = option.get(_requant_group(name))
            if fmt is None:
                continue
            x = _dequantised(t.float().numpy(), fmt)
            tensors[name] = torch.from_numpy(x).to(torch.bfloat16)
            assert torch.equal(tensors[name].float(), torch.from_numpy(x)), f"{name}: not exact in bf16"
            changed.append(name)
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    return changed


@pytest.fixture(scope="module")
def models(cache, tmp_path_factory):
    require_library()
    pytest.importorskip("torch")
    from dsv4_ort.models import load_model, write_random_checkpoint

    root = tmp_path_factory.mktemp("requant")
    src = root / "ck"
    write_random_checkpoint(src, config("tiny"), weights="bf16", seed=5)
    copy = root / "ck-requantised"
    changed = _write_requantised_copy(src, copy, OPTION)
    opt = export_model(src, root / "opt", logits="all", max_seq_len=256, progress=False, **OPTION)
    ref = export_model(copy, root / "ref", logits="all", max_seq_len=256, progress=False)
    return {"option": opt, "copy": ref, "changed": changed, "reference": load_model(copy)}


def test_covered_tensors_and_graph(models):
    changed = set(models["changed"])
    assert "head.weight" in changed and "layers.0.attn.wq_a.weight" in changed
    assert "layers.0.ffn.shared_experts.w1.weight" in changed
    assert not any(n.startswith("embed") or ".ffn.experts." in n or n.endswith("ffn.gate.weight") for n in changed)
    g = onnx.load(str(models["option"]), load_external_data=False).graph
    ops = {n.name: n.op_type for n in g.node}
    op_of = {n.input[1]: n.op_type for n in g.node if n.op_type.startswith("Linear")}
    assert op_of["head.weight"] == "LinearFp8"
    assert op_of["layers.0.attn.wq_a.weight"] == "LinearFp4"
    assert op_of["layers.0.ffn.gate.weight"] == "Linear"
    assert "MoeExpertsFp4" in ops.values()  # the shared expert
    meta = Session(models["option"].parent).meta
    # the MTP draft head is recorded too: "shared" for an export without the MTP graph
    assert meta["weights"]["requantized"] == {**OPTION, "mtp_head": "shared"}
    assert meta["weights"]["formats"]["head"] == ["fp8"]


@pytest.mark.parametrize("level", available_isa_levels())
def test_option_equals_the_requantised_checkpoint(models, level):
    ids = random_ids(config("tiny").vocab_size, (1, 40), seed=9)
    a = Session(models["option"].parent, intra_op_threads=1, isa=level)
    b = Session(models["copy"].parent, intra_op_threads=1, isa=level)
    la, lb = a.forward(ids, a.new_state(1)), b.forward(ids, b.new_state(1))
    assert rel_err(la, lb) < 1e-5
    assert rel_err(la, reference_logits(models["reference"], ids)) < REL_TOL
    assert a.generate(ids[0, :8].tolist(), 6) == b.generate(ids[0, :8].tolist(), 6)


def test_bad_options_and_shapes(tmp_path):
    with pytest.raises(ExportError, match="head"):
        export_model(None, tmp_path / "x", preset="tiny", head="int3", progress=False)
    with pytest.raises(ExportError, match="dense"):
        export_model(None, tmp_path / "y", preset="tiny", dense="fp16", progress=False)
    from dsv4_ort.models.synthetic import ArrayTensor

    a = ArrayTensor("layers.0.attn.wq_a.weight", np.ones((4, 48), np.float32), None, "fp32", None)
    with pytest.raises(WeightFormatError, match="multiple of 32"):
        requantize(a, convert(a, a.name, "native"), "fp4")
    fp8 = requantize(a, convert(a, a.name, "native"), "fp8")
    assert fp8.fmt == "fp8" and fp8.scale.dims == (1, 1)
    np.testing.assert_array_equal(QN.dequant_fp8_block(fp8.weight.data, fp8.scale.data), np.ones((4, 48)))


# ---- --compute bf16: the linears', experts' and attention's products in bf16 (op attribute compute="bf16") ----

def compute_export(cache, tmp_path, compute: str):
    """The tiny preset exported with ``--compute``: the set of ``compute`` attributes per linear / expert / attention
    op type (None where a node has none), the session's recorded mode, its logits on 24 random ids, and their
    relative error against the reference's per position."""
    path = export_model(cache.checkpoint("tiny"), tmp_path / compute, logits="all", max_seq_len=256, progress=False,
                        compute=compute)
    modes = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        if n.op_type.startswith(("Linear", "MoeExperts", "SparseAttention")):
            mode = next((onnx.helper.get_attribute_value(a) for a in n.attribute if a.name == "compute"), None)
            modes.setdefault(n.op_type, set()).add(mode)
    sess = Session(path.parent, intra_op_threads=1)
    ids = random_ids(config("tiny").vocab_size, (1, 24), seed=12)
    ref = reference_logits(cache.reference(("tiny",)), ids)
    got = sess.forward(ids, sess.new_state(1))
    errs = np.array([rel_err(got[:, t], ref[:, t]) for t in range(ids.shape[1])])
    return modes, sess.meta["compute"], got, errs


def test_compute_bf16_export(cache, tmp_path):
    modes, meta, _, errs = compute_export(cache, tmp_path, "bf16")
    assert modes and all(m == {b"bf16"} for m in modes.values()), modes
    assert meta == "bf16"
    # bf16 products: a bf16-sized change at each position, not an exact result and not a broken one. The experts'
    # bf16 rounding can also tip a near-tied expert choice in a later layer, which moves that position as a whole
    # (random weights have such ties), so a few positions may differ by more.
    assert 1e-6 < np.median(errs) < 2e-2, errs
    assert (errs < 2e-2).mean() >= 0.8, errs
    with pytest.raises(ExportError, match="compute"):
        export_model(None, tmp_path / "bad", preset="tiny", compute="fp16", progress=False)


def test_compute_int8_export(cache, tmp_path):
    """--compute int8: every MoeExpertsFp4 node carries compute="int8", every other linear / expert / attention node
    "bf16"; the logits stay near the reference's and differ from the --compute bf16 export's."""
    modes, meta, got, errs = compute_export(cache, tmp_path, "int8")
    assert modes.pop("MoeExpertsFp4") == {b"int8"}
    assert modes and all(m == {b"bf16"} for m in modes.values()), modes
    assert meta == "int8"
    # about 2.5x the bf16 export's error (median 1.6e-2 against 6.4e-3 on these ids), with the same near-tied expert
    # choices moving a few positions as a whole
    assert 1e-6 < np.median(errs) < 3e-2, errs
    assert (errs < 5e-2).mean() >= 0.75, errs
    assert not np.array_equal(got, compute_export(cache, tmp_path, "bf16")[2])
