"""Exporter error handling: clear exception types and messages naming the file / tensor / field, exit status 2 from
the CLI, and no half-written output that looks valid."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil

import pytest
from model_fixtures import config

from dsv4_ort.export import ExportError, export_model
from dsv4_ort.export import cli as export_cli
import dsv4_ort.models as C

CK = ("fast", "deepseek", "bf16")  # bf16 weights: quick to write


@pytest.fixture()
def ck(cache, tmp_path):
    """A private copy of a small valid checkpoint, free to break."""
    dst = tmp_path / "ck"
    shutil.copytree(cache.checkpoint(*CK), dst)
    return dst


def _export(ck, out, **kw):
    kw.setdefault("max_seq_len", 64)
    kw.setdefault("progress", False)
    return export_model(ck, out, **kw)


def _shard(ck) -> str:
    return sorted(p for p in os.listdir(ck) if p.endswith(".safetensors"))[0]


def _assert_nothing_valid(out):
    """No model.onnx and no temporary files in out (which may not exist at all)."""
    if os.path.exists(out):
        assert not any(n.startswith("model.onnx") or ".tmp-" in n for n in os.listdir(out)), os.listdir(out)


def _digest(path) -> dict:
    return {n: hashlib.sha256((path / n).read_bytes()).hexdigest() for n in sorted(os.listdir(path))}


# ----------------------------------------------------------------------------------------------------- checkpoint


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(C.CheckpointNotFoundError, match="nope") as e:
        _export(tmp_path / "nope", tmp_path / "out")
    assert isinstance(e.value, FileNotFoundError)
    assert not (tmp_path / "out").exists()


def test_missing_config(ck, tmp_path):
    os.remove(ck / "config.json")
    with pytest.raises(C.CheckpointNotFoundError, match="config.json"):
        _export(ck, tmp_path / "out")


def test_unknown_architecture(ck, tmp_path):
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.UnsupportedModelError, match="model_type is 'llama'.*config.json"):
        _export(ck, tmp_path / "out")


def test_invalid_config_field(ck, tmp_path):
    cfg = json.loads((ck / "config.json").read_text())
    cfg["hidden_size"] = -1
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.UnsupportedModelError, match="hidden_size.*config.json"):
        _export(ck, tmp_path / "out")


def test_truncated_shard(ck, tmp_path):
    shard = ck / _shard(ck)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(C.CorruptCheckpointError, match=f"truncated shard.*{shard.name}"):
        _export(ck, tmp_path / "out")
    _assert_nothing_valid(tmp_path / "out")


def test_missing_tensor(ck, tmp_path):
    from safetensors.torch import load_file, save_file

    idx = json.loads((ck / C.INDEX_FILE).read_text())
    name = "layers.2.attn.compressor.ape"
    shard = ck / idx["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    (ck / C.INDEX_FILE).write_text(json.dumps(idx))
    with pytest.raises(C.MissingTensorError, match=name):
        _export(ck, tmp_path / "out")
    _assert_nothing_valid(tmp_path / "out")


def test_tensor_of_another_configuration(ck, tmp_path):
    cfg = json.loads((ck / "config.json").read_text())
    cfg["vocab_size"] = 500
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.ShapeMismatchError, match=r"embed\.weight.*safetensors"):
        _export(ck, tmp_path / "out")
    _assert_nothing_valid(tmp_path / "out")


def test_unexpected_tensor(ck, tmp_path):
    cfg = json.loads((ck / "config.json").read_text())
    cfg["compress_ratios"] = [0] + cfg["compress_ratios"][1:]  # layer 0 loses its compressor and indexer
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.UnexpectedTensorError, match=r"layers\.0\.attn\.compressor"):
        _export(ck, tmp_path / "out")
    _assert_nothing_valid(tmp_path / "out")


def test_failed_export_keeps_a_previous_export_intact(ck, tmp_path):
    out = tmp_path / "out"
    _export(ck, out)
    before = _digest(out)
    shard = ck / _shard(ck)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    with pytest.raises(C.CorruptCheckpointError):
        _export(ck, out)
    assert _digest(out) == before


def test_failure_while_building_the_graph_leaves_no_temporary_files(ck, tmp_path, monkeypatch):
    from dsv4_ort.export import graph

    def boom(self):
        raise graph.GraphBuildError("injected")

    monkeypatch.setattr(graph.DecoderGraph, "build", boom)
    with pytest.raises(graph.GraphBuildError, match="injected"):
        _export(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # staged beside the target, removed on failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


# ----------------------------------------------------------------------------------------------------- arguments


def test_output_path_is_a_file(ck, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="not a directory.*file"):
        _export(ck, tmp_path / "file")
    with pytest.raises(ExportError, match="cannot create the output directory.*sub"):
        _export(ck, tmp_path / "file" / "sub")


def test_max_seq_len_rules(ck, tmp_path):
    # fast config: ratios 4 and 16 -> multiples of 16; max_position_embeddings 1024
    with pytest.raises(ExportError, match=r"max_seq_len=100 must be a positive multiple of 16.*96, 112"):
        _export(ck, tmp_path / "out", max_seq_len=100)
    with pytest.raises(ExportError, match=r"max_seq_len=8 .*smallest valid value: 16"):
        _export(ck, tmp_path / "out", max_seq_len=8)
    with pytest.raises(ExportError, match="exceeds the model's max_position_embeddings=1024"):
        _export(ck, tmp_path / "out", max_seq_len=2048)
    with pytest.raises(ExportError, match="integer"):
        _export(ck, tmp_path / "out", max_seq_len=64.0)
    _assert_nothing_valid(tmp_path / "out")


@pytest.mark.parametrize("kw, match", [({"weights": "int4"}, "weights must be one of"),
                                       ({"logits": "first"}, "logits must be one of"),
                                       ({"max_batch": 0}, "max_batch must be a positive integer"),
                                       ({"preset": "tiny"}, "not both")])
def test_bad_arguments(ck, tmp_path, kw, match):
    with pytest.raises(ExportError, match=match):
        _export(ck, tmp_path / "out", **kw)


def test_neither_checkpoint_nor_preset(tmp_path):
    with pytest.raises(ExportError, match="checkpoint directory or a preset"):
        export_model(None, tmp_path / "out")


def test_unknown_preset(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        export_model(None, tmp_path / "out", preset="huge")


# ----------------------------------------------------------------------------------------------------- CLI


def _cli(argv):
    parser = argparse.ArgumentParser(prog="dsv4-ort")
    export_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_success(ck, tmp_path, capsys):
    assert _cli(["export", str(ck), str(tmp_path / "out"), "--max-seq-len", "64", "--quiet"]) == 0
    assert (tmp_path / "out" / "model.onnx").is_file()
    assert _cli(["export", str(ck), str(tmp_path / "out2"), "--max-seq-len", "64", "--weights", "fp32",
                 "--logits", "all", "--max-batch", "3"]) == 0
    meta = json.loads((tmp_path / "out2" / "dsv4_ort.json").read_text())
    assert (meta["weights"]["mode"], meta["logits"], meta["max_batch"]) == ("fp32", "all", 3)
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["export", "{tmp}/nope", "{tmp}/out"], "checkpoint directory not found"),
    (["export", "{ck}", "{tmp}/out", "--max-seq-len", "100"], "multiple of 16"),
    (["export", "{ck}"], "expected CHECKPOINT_DIR OUT_DIR"),
    (["export", "--preset", "tiny", "{ck}", "{tmp}/out"], "with --preset give only OUT_DIR"),
    (["export", "{ck}", "{tmp}/file"], "not a directory"),
])
def test_cli_errors_exit_2_with_one_line(ck, tmp_path, capsys, argv, match):
    (tmp_path / "file").write_text("x")
    argv = [a.format(tmp=tmp_path, ck=ck) for a in argv]
    assert _cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dsv4-ort export: error: ") and match in err, err


def test_cli_argument_errors_exit_2(ck, tmp_path):
    for bad in (["--max-seq-len", "0"], ["--weights", "int4"], ["--max-batch", "x"]):
        with pytest.raises(SystemExit) as e:
            _cli(["export", str(ck), str(tmp_path / "out"), *bad])
        assert e.value.code == 2


def test_cli_unknown_preset_and_light_import(tmp_path, capsys):
    assert _cli(["export", "--preset", "huge", str(tmp_path / "out")]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err
    import subprocess
    import sys

    # building the dsv4-ort parser must not need torch / onnx (dsv4-ort info and run work without them)
    code = ("import argparse, sys; from dsv4_ort.export import cli; p = argparse.ArgumentParser(); "
            "cli.add_parser(p.add_subparsers()); print('torch' in sys.modules, 'onnx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout
    assert out.split() == ["False", "False"]
