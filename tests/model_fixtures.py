"""Shared pieces of the exporter tests: small configs, cached random checkpoints / exports / reference models, and a
minimal onnxruntime driver that binds every state buffer as both past and present (IOBinding)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

CONFIGS = {
    # The preset: SWA, CSA (r=4), HCA (r=128), CSA; hash MoE in layers 0-1. Window 16, index_topk 8.
    "tiny": {},
    # Same shapes with an HCA ratio of 16, so short sequences cross several compress boundaries.
    "fast": {"compress_ratios": [4, 0, 16, 4, 0], "num_hash_layers": 1},
}

# Relative logit error allowed between onnxruntime and the PyTorch reference (max |diff| / max |logit|). Both
# compute in float32; the observed error is ~1e-6, the margin covers other summation orders (ISA variants).
REL_TOL = 1e-4

NEEDED_OPS = {"Linear", "LinearFp8", "LinearFp4", "MoeExperts", "MoeExpertsFp8", "MoeExpertsFp4", "RmsNorm",
              "NormRope", "Rope", "Compressor", "Indexer", "SparseAttention", "HcPre", "HcPost", "HcHead",
              "MoeRouteTopK", "MoeRouteHash"}


def config(name: str):
    from dsv4_ort.models.config import DeepseekV4Config

    base = DeepseekV4Config.from_preset("tiny")
    return base.replace(**CONFIGS[name]) if CONFIGS[name] else base


def require_library() -> None:
    import dsv4_ort

    try:
        ops = set(dsv4_ort.library_info()["ops"])
    except Exception as e:  # pragma: no cover - reported as a failure with the reason
        pytest.fail(f"custom-op library unavailable: {e}")
    missing = NEEDED_OPS - ops
    if missing:
        pytest.fail(f"the custom-op library lacks {sorted(missing)}")


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(ref, np.float64)).max() / np.abs(ref).max())


class OrtModel:
    """An exported model in onnxruntime with in-place state (same OrtValue bound as past and present)."""

    def __init__(self, path, threads: int = 1):
        import onnxruntime as ort

        import dsv4_ort

        self.path = Path(path)
        self.meta = json.loads((self.path.parent / "dsv4_ort.json").read_text())
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        dsv4_ort.register(so)
        self.sess = ort.InferenceSession(str(self.path), so, providers=["CPUExecutionProvider"])

    def new_state(self, batch: int) -> dict:
        """name -> numpy buffer (zeros); the OrtValues wrap these arrays, so updates are visible in numpy."""
        dtypes = {"float": np.float32, "uint8": np.uint8}  # uint8: FP8 state rows (exports with state="fp8")
        return {t["input"]: np.zeros([batch] + t["shape"][1:], dtypes[t["dtype"]])
                for t in self.meta["state"]["tensors"]}

    def run(self, ids, start_pos, state: dict) -> np.ndarray:
        import onnxruntime as ort

        io = self.sess.io_binding()
        io.bind_ortvalue_input("input_ids", ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(ids, np.int64)))
        io.bind_ortvalue_input("start_pos",
                               ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(start_pos, np.int64)))
        for t in self.meta["state"]["tensors"]:
            buf = state[t["input"]]
            assert buf.flags.c_contiguous and buf.dtype in (np.float32, np.uint8)
            v = ort.OrtValue.ortvalue_from_numpy(buf)  # wraps the numpy memory, no copy
            io.bind_ortvalue_input(t["input"], v)
            io.bind_ortvalue_output(t["output"], v)
        io.bind_output("logits", "cpu")
        self.sess.run_with_iobinding(io)
        return io.copy_outputs_to_cpu()[-1]


class Cache:
    """Cache (one per test run) of random checkpoints, exports, reference models and onnxruntime models."""

    def __init__(self, root: Path):
        self.root = root
        self._ck, self._ex, self._ref, self._ort = {}, {}, {}, {}

    def checkpoint(self, cfg: str = "tiny", naming: str = "deepseek", weights: str = "native", seed: int = 0) -> Path:
        key = (cfg, naming, weights, seed)
        if key not in self._ck:
            from dsv4_ort.models import write_random_checkpoint

            path = self.root / f"ck-{cfg}-{naming}-{weights}-{seed}"
            with one_torch_thread():
                write_random_checkpoint(path, config(cfg), naming=naming, weights=weights, seed=seed)
            self._ck[key] = path
        return self._ck[key]

    def export(self, ck_key: tuple = ("tiny",), weights: str = "native", logits: str = "all",
               max_seq_len: int = 256, state: str = "default") -> Path:
        key = (tuple(ck_key), weights, logits, max_seq_len, state)
        if key not in self._ex:
            from dsv4_ort.export import export_model

            out = self.root / ("ex-" + "-".join(map(str, ck_key)) + f"-{weights}-{logits}-{max_seq_len}"
                               + ("" if state == "default" else f"-{state}"))
            self._ex[key] = export_model(self.checkpoint(*ck_key), out, weights=weights, logits=logits,
                                         max_seq_len=max_seq_len, progress=False, state=state)
        return self._ex[key]

    def reference(self, ck_key: tuple = ("tiny",)):
        key = tuple(ck_key)
        if key not in self._ref:
            from dsv4_ort.models import load_model

            with one_torch_thread():
                self._ref[key] = load_model(self.checkpoint(*ck_key))
        return self._ref[key]

    def ort(self, model_path, threads: int = 1) -> OrtModel:
        key = (str(model_path), threads)
        if key not in self._ort:
            self._ort[key] = OrtModel(model_path, threads)
        return self._ort[key]


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Cache:
    return Cache(tmp_path_factory.mktemp("export"))


class one_torch_thread:
    """torch on one thread: on a busy 2-core machine its OpenMP barriers otherwise cost 10-100x."""

    def __enter__(self):
        import torch

        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.n)


def reference_logits(model, ids) -> np.ndarray:
    """Full-prefill logits [B, S, V] of the PyTorch reference."""
    import torch

    with torch.no_grad(), one_torch_thread():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.int64)).numpy()


def random_ids(vocab: int, shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int64)


def dir_listing(path) -> list:
    return sorted(os.listdir(path))
