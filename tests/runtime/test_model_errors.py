"""Damaged exported models: missing or truncated external data, a truncated graph, a dsv4_ort.json that is
incomplete or does not describe the graph next to it, a newer op table. The Session refuses each with a ModelError
naming the file and the problem; the command line exits 2 with one line on stderr."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from dsv4_ort.runtime import ModelError, Session


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from dsv4_ort.export import export_model

    out = tmp_path_factory.mktemp("model") / "tiny"
    export_model(None, out, preset="tiny", max_seq_len=128, logits="last", progress=False)
    return out


def _truncate(path, keep):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep) if isinstance(keep, float) else size - keep)


def _meta(change):
    def apply(d):
        meta = json.loads((d / "dsv4_ort.json").read_text())
        change(meta)
        (d / "dsv4_ort.json").write_text(json.dumps(meta))
    return apply


def _graph_metadata(key, value):
    """Sets a metadata_props entry of model.onnx (its external data left as is)."""
    def apply(d):
        import onnx

        model = onnx.load(str(d / "model.onnx"), load_external_data=False)
        for p in model.metadata_props:
            if p.key == key:
                p.value = value
        onnx.save(model, str(d / "model.onnx"))
    return apply


def _replace_trailer(d, export_id):
    from dsv4_ort.export import read_export_trailer
    from dsv4_ort.export.files import export_trailer

    path = d / "model.onnx.data"
    assert read_export_trailer(path)
    with open(path, "r+b") as f:
        f.seek(-len(export_trailer(export_id)), os.SEEK_END)
        f.write(export_trailer(export_id))


def _swap_pair(meta, i, j):
    """Two state entries exchange their outputs: past.A paired with present.B (each name still in the graph)."""
    a, b = meta["state"]["tensors"][i], meta["state"]["tensors"][j]
    a["output"], b["output"] = b["output"], a["output"]


def _set_state(i, field, value):
    return _meta(lambda m: m["state"]["tensors"][i].__setitem__(field, value))


DAMAGE = {
    "data file missing": (lambda d: os.remove(d / "model.onnx.data"), r"model\.onnx.*External data path does not exist"),
    "data file cut in half": (lambda d: _truncate(d / "model.onnx.data", 0.5), r"model\.onnx\.data ends without"),
    "data file short by 4 bytes": (lambda d: _truncate(d / "model.onnx.data", 4), r"model\.onnx\.data ends without"),
    "data file of another export": (lambda d: _replace_trailer(d, "0" * 32), r"mixes files of different exports"),
    "graph of another export": (_graph_metadata("dsv4_ort.export_id", "0" * 32),
                                r"export_id [0-9a-f]{32} in the JSON, 0{32} in the graph"),
    "json of another export": (_meta(lambda m: m.__setitem__("export_id", "1" * 32)),
                               r"mixes files of different exports"),
    "json of an older format": (_meta(lambda m: m.pop("export_id")), r"export format .* re-export"),
    "json past/present swapped": (_meta(lambda m: _swap_pair(m, 0, 1)), r"is not past\.X / present\.X"),
    "json state tensor missing": (_meta(lambda m: m["state"]["tensors"].pop(2)),
                                  r"graph input 'past\.\S+' is not in the JSON's state tensors"),
    "json logits mode differs": (_meta(lambda m: m.__setitem__("logits", "all")), r"logits all in the JSON, last"),
    "graph cut in half": (lambda d: _truncate(d / "model.onnx", 0.5), r"model\.onnx.*(Protobuf parsing failed)"),
    "graph empty": (lambda d: _truncate(d / "model.onnx", 0.0), r"model\.onnx"),
    "json not an object": (lambda d: (d / "dsv4_ort.json").write_text("[1, 2]"), "does not describe a dsv4-ort model"),
    "json without config": (_meta(lambda m: m.pop("config")), r"dsv4_ort\.json is corrupt: 'config'"),
    "json without state": (_meta(lambda m: m.pop("state")), r"dsv4_ort\.json is corrupt: 'state'"),
    "json without max_seq_len": (_meta(lambda m: m.pop("max_seq_len")), "'max_seq_len' must be a positive integer"),
    "json max_seq_len a string": (_meta(lambda m: m.__setitem__("max_seq_len", "128")), "'max_seq_len' must be"),
    "json state entry broken": (_set_state(0, "shape", None), "malformed state tensor entry"),
    "json state shape differs": (_set_state(0, "shape", ["batch", 3, 128]),
                                 r"does not match .*model\.onnx: state tensor 'past\.0\.window' has shape"),
    "json state dtype differs": (_set_state(0, "dtype", "bfloat16"), r"state tensor 'past\.0\.window' is tensor\(float\)"),
    "json state tensor unknown": (_meta(lambda m: m["state"]["tensors"][0].update(input="past.0.nothing",
                                                                               output="present.0.nothing")),
                                  "the graph has no state tensor"),
    "json vocabulary differs": (_meta(lambda m: m["config"].__setitem__("vocab_size", 1000)), "the vocabulary 1000"),
    "json capacity differs": (_meta(lambda m: m.__setitem__("max_seq_len", 4096)),
                              "max_seq_len 4096 in the JSON, 128 in the graph"),
    "json newer op table": (_meta(lambda m: m.__setitem__("op_table_version", 7)), "exported for op table v7"),
    "graph newer op table": (_graph_metadata("dsv4_ort.op_table_version", "7"),
                             "op_table_version 1 in the JSON, 7 in the graph"),
}


@pytest.fixture()
def damaged(exported, tmp_path, request):
    damage, match = DAMAGE[request.param]
    d = tmp_path / "m"
    shutil.copytree(exported, d)
    damage(d)
    return d, match


@pytest.mark.parametrize("damaged", sorted(DAMAGE), indirect=True)
def test_session_refuses_damaged_model(damaged):
    d, match = damaged
    with pytest.raises(ModelError, match=match) as e:
        Session(d, intra_op_threads=1)
    assert "\n" not in str(e.value)


def test_undamaged_copy_loads(exported, tmp_path):
    shutil.copytree(exported, tmp_path / "m")
    sess = Session(tmp_path / "m", intra_op_threads=1)
    assert len(sess.generate([1, 2, 3], 2)) == 2


@pytest.mark.parametrize("damaged", ["data file cut in half", "graph cut in half", "json without state",
                                     "json capacity differs", "graph newer op table"], indirect=True)
def test_command_line_exits_2_with_one_line(damaged):
    d, match = damaged
    exe = os.path.join(os.path.dirname(sys.executable), "dsv4-ort")
    r = subprocess.run([exe, "generate", str(d), "--ids", "1,2,3", "--max-new-tokens", "2"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv4-ort generate: error: "), r.stderr
    assert r.stdout == ""
