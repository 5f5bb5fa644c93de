"""The tree's paths are its imports, and the suite refuses to test a copy that is not this checkout."""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def _modules():
    for f in sorted((SRC / "dsv4_ort").rglob("*.py")):
        parts = f.relative_to(SRC).with_suffix("").parts
        yield f, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_python_file_imports_by_its_path():
    import dsv4_ort

    pkg = Path(dsv4_ort.__file__).resolve().parent
    assert not (ROOT / "dsv4_ort").exists(), "a root dsv4_ort/ folder would shadow the installed package"
    for f, name in _modules():
        if name.endswith("__main__"):
            continue
        mod = importlib.import_module(name)
        installed = Path(mod.__file__).resolve()
        assert installed == pkg / f.relative_to(SRC / "dsv4_ort"), (name, installed)
        assert installed.read_bytes() == f.read_bytes(), f"{name}: installed copy differs from {f}"


def test_a_shadowing_or_stale_copy_is_refused(tmp_path, monkeypatch):
    """tests/conftest.py stops the run (pytest.exit) when it would import other sources or an older library."""
    import importlib.util

    import dsv4_ort

    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    assert conftest._stale_or_shadowed() is None
    shadow = tmp_path / "dsv4_ort"
    shutil.copytree(Path(dsv4_ort.__file__).resolve().parent, shadow, ignore=shutil.ignore_patterns("__pycache__"))
    (shadow / "cli.py").write_text((shadow / "cli.py").read_text() + "\n# an older copy\n")
    monkeypatch.setattr(dsv4_ort, "__file__", str(shadow / "__init__.py"))
    assert "cli.py differs from this checkout" in conftest._stale_or_shadowed()
    monkeypatch.undo()

    old = tmp_path / "libdsv4_ort.so"
    old.write_bytes(b"")
    os.utime(old, (0, 0))
    monkeypatch.delenv("DSV4_ORT_LIBRARY", raising=False)
    monkeypatch.setattr(dsv4_ort, "get_library_path", lambda: str(old))
    assert "is older than" in conftest._stale_or_shadowed()
