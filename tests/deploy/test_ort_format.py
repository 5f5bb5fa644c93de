"""The tiny preset converted to the ORT format by onnxruntime's own converter, run through ``Session``.

``python -m onnxruntime.tools.convert_onnx_models_to_ort --custom_op_library libdsv4_ort.so`` loads the model with
the library registered (so our ops resolve), optimises it and writes one flatbuffer holding the graph and every
weight. ``Session(dir, model_file="model.ort")`` runs it beside the export's dsv4_ort.json.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from deploy_helpers import convert_to_ort_format, read_meta, run_in_place, session_options
from model_fixtures import dir_listing, random_ids, require_library

from dsv4_ort.runtime import ModelError, Session


@pytest.fixture(scope="module")
def tiny(cache):
    require_library()
    return cache.export(("tiny",), logits="last", max_seq_len=256).parent


@pytest.fixture(scope="module")
def ort_dir(tiny, tmp_path_factory):
    """A deployment directory holding only model.ort and dsv4_ort.json (no model.onnx, no external data)."""
    out = tmp_path_factory.mktemp("ort")
    before = dir_listing(tiny)
    convert_to_ort_format(tiny / "model.onnx", out)
    assert dir_listing(tiny) == before, "the converter wrote into the model directory"
    assert (out / "model.ort").is_file()
    (out / "model.required_operators.config").unlink()  # the op list for minimal onnxruntime builds
    shutil.copy(tiny / "dsv4_ort.json", out)
    return out


def test_converted_model_matches_onnx_bit_for_bit(tiny, ort_dir):
    import onnxruntime as ort

    meta = read_meta(tiny)
    prompt, steps = random_ids(meta["config"]["vocab_size"], (1, 21), seed=21), [5, 77, 300, 2]
    onnx_sess = ort.InferenceSession(str(tiny / "model.onnx"), session_options(), providers=["CPUExecutionProvider"])
    ort_sess = ort.InferenceSession(str(ort_dir / "model.ort"), session_options(), providers=["CPUExecutionProvider"])
    assert ort_sess.get_modelmeta().custom_metadata_map["dsv4_ort.export_id"] == meta["export_id"]
    for i, (a, b) in enumerate(zip(run_in_place(ort_sess, meta, prompt, steps),
                                   run_in_place(onnx_sess, meta, prompt, steps))):
        np.testing.assert_array_equal(a, b, err_msg=f"run {i} (0 = prefill)")


def test_session_runs_the_ort_format(tiny, ort_dir):
    ours = Session(ort_dir, intra_op_threads=1, model_file="model.ort")
    ref = Session(tiny, intra_op_threads=1)
    assert ours.model_path == ort_dir / "model.ort"
    prompt = random_ids(ref.vocab_size, (12,), seed=22).tolist()
    assert ours.generate(prompt, 24) == ref.generate(prompt, 24)
    batch = random_ids(ref.vocab_size, (2, 7), seed=23)
    assert ours.generate(batch, 6) == ref.generate(batch, 6)
    np.testing.assert_array_equal(ours.forward(batch, ours.new_state(2)), ref.forward(batch, ref.new_state(2)))


def test_damaged_ort_files_are_model_errors(ort_dir, tmp_path):
    shutil.copy(ort_dir / "dsv4_ort.json", tmp_path)
    data = (ort_dir / "model.ort").read_bytes()
    cases = {"empty.ort": b"", "garbage.ort": b"\x00" * 64, "truncated.ort": data[:4096],
             "misnamed.ort": (ort_dir / "dsv4_ort.json").read_bytes()}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelError, match=f"cannot load .*{name}"):
            Session(tmp_path, model_file=name)
    with pytest.raises(ModelError, match="needs model.ort"):
        Session(tmp_path / "..", model_file="model.ort")
    for bad in ("../model.ort", "model.bin", "sub/model.ort"):
        with pytest.raises(ValueError, match="model_file must be a file name"):
            Session(ort_dir, model_file=bad)
    with pytest.raises(TypeError, match="model_file must be a str"):
        Session(ort_dir, model_file=None)


def test_misspelled_attribute_in_an_ort_model_is_refused(tiny, tmp_path):
    """The attribute check reads the flatbuffer's nodes as it reads model.onnx's (onnxruntime itself would ignore an
    attribute that no kernel asks for)."""
    import onnx

    src = tmp_path / "src"
    src.mkdir()
    model = onnx.load(str(tiny / "model.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "RmsNorm")
    node.attribute.append(onnx.helper.make_attribute("epsilonn", 1e-6))
    onnx.save(model, str(src / "model.onnx"))
    # a copy, not a symlink: onnxruntime refuses external data that resolves outside the model's directory
    shutil.copy(tiny / "model.onnx.data", src)
    out = tmp_path / "out"
    convert_to_ort_format(src / "model.onnx", out)
    shutil.copy(tiny / "dsv4_ort.json", out)
    with pytest.raises(ModelError, match=f"RmsNorm node '{node.name}' has attribute 'epsilonn'"):
        Session(out, model_file="model.ort")
