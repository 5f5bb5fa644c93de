"""Locating, registering and querying the custom-op library."""

from __future__ import annotations

import json
import os
from pathlib import Path

LIBRARY_NAME = "libdsv4_ort.so"


def get_library_path() -> str:
    """Absolute path of the built custom-op library (``DSV4_ORT_LIBRARY`` overrides)."""
    override = os.environ.get("DSV4_ORT_LIBRARY")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"DSV4_ORT_LIBRARY={override!r} does not exist")
        return str(Path(override).resolve())
    candidates = [Path(__file__).resolve().parent / "lib" / LIBRARY_NAME]
    try:  # editable installs keep the built library in site-packages, apart from the sources
        from importlib import resources

        candidates.append(Path(str(resources.files("dsv4_ort") / "lib" / LIBRARY_NAME)))
    except Exception:
        pass
    import sysconfig

    for key in ("platlib", "purelib"):
        candidates.append(Path(sysconfig.get_paths()[key]) / "dsv4_ort" / "lib" / LIBRARY_NAME)
    for c in candidates:
        if c.is_file():
            return str(c)
    raise FileNotFoundError(
        f"{LIBRARY_NAME} not found (looked in {', '.join(str(c) for c in candidates)}); "
        "build and install the package with `pip install .`")


MIN_ONNXRUNTIME = (1, 21)  # C API version 21 (the headers the library is built against)


def check_onnxruntime() -> None:
    """Raises RuntimeError when the importable onnxruntime is older than the library needs."""
    import onnxruntime as ort

    try:
        have = tuple(int(p) for p in ort.__version__.split(".")[:2])
    except ValueError:  # a development build with an unusual version string: let registration decide
        return
    if have < MIN_ONNXRUNTIME:
        need = ".".join(map(str, MIN_ONNXRUNTIME))
        raise RuntimeError(f"onnxruntime {ort.__version__} is too old: dsv4-ort needs onnxruntime >= {need} "
                           f"(pip install 'onnxruntime>={need}')")


def register(session_options) -> None:
    """Registers the custom-op library with an ``onnxruntime.SessionOptions`` (onnxruntime >= 1.21)."""
    check_onnxruntime()
    session_options.register_custom_ops_library(get_library_path())


def library_info(isa: str | None = None, kernels: str | None = None, batch_invariant: int | None = None) -> dict:
    """What the library reports about itself in a session: op table, CPU (vendor, family, model, features), the
    ISA level of each kernel family and why (``family_source``: ``cap``, ``cpu`` policy or ``forced``), and the
    batch-invariance bound (``batch_invariant_rows``, 0 = off), and whether the linear / expert rows path prefetches
    bf16 / fp32 weight rows in software (``weight_prefetch``, with ``weight_prefetch_source`` as for families),
    whether bf16 SparseAttention inputs are multiplied on VDPBF16PS at the avx512 level (``bf16_dot``, with
    ``bf16_dot_source``), and
    the resident-weights policy (``resident_weights``: ``policy`` of ``DSV4_ORT_RESIDENT_WEIGHTS``,
    ``huge_pages_offered``, ``min_bytes``, and ``bytes_now`` held in copies by this process).

    ``isa`` caps the level like ``DSV4_ORT_ISA``, ``kernels`` forces families like ``DSV4_ORT_KERNELS``,
    ``batch_invariant`` sets ``DSV4_ORT_BATCH_INVARIANT`` (all read when the library is registered).
    """
    import numpy as np
    import onnxruntime as ort

    from onnx import TensorProto, helper

    from .export import schema

    node = helper.make_node("LibraryInfo", ["unused"], ["info"], domain=schema.DOMAIN)
    graph = helper.make_graph([node], "library_info", [helper.make_tensor_value_info("unused", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("info", TensorProto.STRING, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)],
                              ir_version=8).SerializeToString()
    with isa_cap(isa, kernels, batch_invariant):
        so = ort.SessionOptions()
        so.log_severity_level = 4
        try:  # onnxruntime calls the library's RegisterCustomOps here, which reads the two variables
            register(so)
            sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        except Exception as e:  # the library refused DSV4_ORT_ISA / DSV4_ORT_KERNELS: say which, as a ValueError
            text = str(e)
            if "dsv4_ort: DSV4_ORT_" in text:
                raise ValueError(text[text.index("dsv4_ort: ") + len("dsv4_ort: "):].strip()) from None
            raise
    (out,) = sess.run(None, {"unused": np.zeros(1, np.int64)})
    info = json.loads(str(out[0]))
    info["library_path"] = get_library_path()
    info["onnxruntime_version"] = ort.__version__
    return info


class isa_cap:
    """Context manager setting DSV4_ORT_ISA (``isa``), DSV4_ORT_KERNELS (``kernels``, per-family levels such as
    ``"linear=avx2,indexer=scalar"``) and DSV4_ORT_BATCH_INVARIANT (``batch_invariant``, a row bound; 0 = off) while
    sessions register the library; None leaves a variable untouched."""

    def __init__(self, isa: str | None, kernels: str | None = None, batch_invariant: int | None = None):
        self.values = {"DSV4_ORT_ISA": isa, "DSV4_ORT_KERNELS": kernels,
                       "DSV4_ORT_BATCH_INVARIANT": None if batch_invariant is None else str(batch_invariant)}
        self.saved = {}

    def __enter__(self):
        for name, value in self.values.items():
            if value is not None:
                self.saved[name] = os.environ.get(name)
                os.environ[name] = value
        return self

    def __exit__(self, *exc):
        for name, old in self.saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        return False
