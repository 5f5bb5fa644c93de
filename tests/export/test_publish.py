"""Publishing an export: the target directory is replaced whole or not at all, concurrent exporters of one target
never mix their files, a killed exporter leaves nothing that outlives the next export, and the three files of a
model carry one export id that the runtime checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv4_ort.export import ExportError, export_model, read_export_trailer
from dsv4_ort.export.files import TRAILER_SIZE
from dsv4_ort.runtime import Session


def _export(out, seed=0, **kw):
    return export_model(None, out, preset="tiny", seed=seed, max_seq_len=128, progress=False, **kw)


def _ids(out: Path) -> tuple:
    meta = json.loads((out / "dsv4_ort.json").read_text())
    return meta["export_id"], read_export_trailer(out / "model.onnx.data")


def _loads(out: Path) -> list:
    return Session(out, intra_op_threads=1).generate([1, 2, 3], 3)


def test_every_export_has_one_fresh_id(tmp_path):
    _export(tmp_path / "m")
    first = _ids(tmp_path / "m")
    _export(tmp_path / "m")
    second = _ids(tmp_path / "m")
    assert first[0] == first[1] and second[0] == second[1] and first[0] != second[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_reexport_replaces_the_directory_whole(tmp_path):
    out = tmp_path / "m"
    _export(out)
    (out / "tokenizer.json").write_text("{}")  # left by an earlier export of a checkpoint with a tokenizer
    _export(out)
    assert sorted(p.name for p in out.iterdir()) == ["dsv4_ort.json", "model.onnx", "model.onnx.data"]


def test_a_directory_of_other_files_is_not_replaced(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="notes.txt"):
        _export(out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.export-")] == []


def test_interrupt_during_publish_keeps_the_previous_model(tmp_path, monkeypatch):
    from dsv4_ort.export import exporter

    out = tmp_path / "m"
    _export(out)
    before = _ids(out)
    expected = _loads(out)

    def interrupted(a, b):
        raise KeyboardInterrupt

    monkeypatch.setattr(exporter, "_rename_exchange", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _export(out, seed=1)
    assert _ids(out) == before and _loads(out) == expected
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.export-")] == []


_KILLED = """
import os, signal, sys
from dsv4_ort.export import exporter
exporter._publish = lambda stage, out: os.kill(os.getpid(), signal.SIGKILL)  # dies with the export staged
exporter.export_model(None, sys.argv[1], preset="tiny", seed=1, max_seq_len=128, progress=False)
"""


def test_sigkill_leaves_the_previous_model_and_no_lasting_temporaries(tmp_path):
    out = tmp_path / "m"
    _export(out)
    before, expected = _ids(out), _loads(out)
    r = subprocess.run([sys.executable, "-c", _KILLED, str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".m.export-")]
    assert len(stale) == 1 and _ids(out) == before and _loads(out) == expected
    _export(out, seed=2)  # the next export of the target removes what the dead one left
    assert not stale[0].exists() and _ids(out) != before


_CONCURRENT = """
import sys
from dsv4_ort.export import export_model
export_model(None, sys.argv[1], preset="tiny", seed=int(sys.argv[2]), max_seq_len=128, progress=False)
"""


def test_concurrent_exports_of_one_target_never_mix(tmp_path):
    """Two exporters race for one target, four times; each time the result is one of them, whole."""
    out = tmp_path / "m"
    refs = {}
    for seed in (1, 2):
        _export(tmp_path / f"ref{seed}", seed=seed)
        refs[seed] = (tmp_path / f"ref{seed}" / "model.onnx.data").read_bytes()[:-TRAILER_SIZE]
    for _ in range(4):
        procs = [subprocess.Popen([sys.executable, "-c", _CONCURRENT, str(out), str(seed)],
                                  stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
        meta_id, data_id = _ids(out)
        assert meta_id == data_id
        data = (out / "model.onnx.data").read_bytes()[:-TRAILER_SIZE]
        assert data in (refs[1], refs[2])
        logits = Session(out, intra_op_threads=1).forward(np.array([[1, 2]]), Session(out).new_state(1))
        assert np.isfinite(logits).all()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".m")) == [".m.lock"]
