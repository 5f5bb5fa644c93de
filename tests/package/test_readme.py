"""The README's Python blocks run as written, so the documented API and the code cannot drift apart.

Each ```python block is executed in a directory holding what the blocks name: ``out/model_dir`` (an export of the
tiny preset) and, for the block that loads ``model.onnx`` directly, that model's files beside it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from dsv4_ort.export import export_model

    root = tmp_path_factory.mktemp("readme")
    model = root / "out" / "model_dir"
    export_model(None, model, preset="tiny", max_seq_len=128, logits="all", progress=False)
    for f in model.iterdir():  # model.onnx, model.onnx.data, dsv4_ort.json beside the blocks
        (root / f.name).symlink_to(f)
    return root


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    code = compile(BLOCKS[index], f"README.md python block {index + 1}", "exec")
    exec(code, {"__name__": f"readme_block_{index + 1}"})
