"""Small ONNX graphs for the kernel benchmarks: N copies of one node, weights served from memory without copies.

Decode-shaped kernels read their weights once per call, so a benchmark that calls one node with one weight measures
the last-level cache, not DRAM. Here a graph holds ``n`` copies of the node, each with its own weight (and state)
taken from a :class:`DataPool` several times the size of the LLC; one ``run`` calls the ``n`` nodes in sequence and
therefore streams the whole pool, and the time per node is the time per run / ``n``. Weights are constant
initializers (so onnxruntime and the kernels see them as they would in an exported model, including any pre-packing)
supplied through ``SessionOptions.add_external_initializers`` straight from the pool's memory. State tensors are
graph inputs bound with IOBinding to the same buffer as the matching output, as the runtime binds them.

Pool contents are valid in every format the ops read: the pool is made of random bfloat16 values (normal numbers
around N(0, 0.5)), so a float32 view holds normal numbers too, an FP8 E4M3 view holds no NaN code (0x7F / 0xFF bytes
are replaced) and any byte is a valid packed FP4 pair. E8M0 scales come from a separate small pool of exponents
120..127. The pool never repeats itself at any offset a view can start at: each 8 MiB tile is the base tile rotated by
its own amount. Views of a plainly repeated tile had equal contents whenever their size divided the period, and
onnxruntime's MatMul pre-packs its weight and gave identical weights one pre-packed copy (4096 x 1024 float32, 50
nodes at M = 1: 156 us per node from those views, as from the LLC, against 822 us from distinct ones, AMD EPYC, 2
threads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# ONNX element types used here: name -> (TensorProto code, numpy storage dtype, bytes per element)
TYPES = {
    "float": (1, np.float32, 4),
    "uint8": (2, np.uint8, 1),
    "int32": (6, np.int32, 4),
    "int64": (7, np.int64, 8),
    "bfloat16": (16, np.uint16, 2),
    "float8e4m3fn": (17, np.uint8, 1),
}

ALIGN = 4096


def nbytes(shape, dtype: str) -> int:
    return int(math.prod(shape)) * TYPES[dtype][2]


class DataPool:
    """A large buffer of format-valid random bytes handed out as consecutive (wrapping) views."""

    def __init__(self, size: int, seed: int = 0, scale_size: int | None = None):
        size = max(ALIGN, (int(size) + ALIGN - 1) // ALIGN * ALIGN)
        rng = np.random.default_rng(seed)
        tile = (rng.standard_normal(1 << 22, dtype=np.float32) * 0.5).view(np.uint32)
        tile = (tile >> 16).astype(np.uint16).view(np.uint8).copy()  # bf16 bit patterns, little-endian bytes
        lo = tile[0::2]
        lo[lo == 0x7F] = 0x7E  # FP8 E4M3 NaN codes never appear (the high bytes are small exponents already)
        lo[lo == 0xFF] = 0xFE
        self.buf = np.empty(size + 64, np.uint8)
        off = (-self.buf.ctypes.data) % 64
        self.data = self.buf[off:off + size]
        # tile t rotated by 2 (40503 t + 1) bytes mod the tile size: even (bf16 values stay whole) and different for
        # every tile (40503 is odd), so no two tiles, and no two views at different offsets, hold the same bytes
        for t, start in enumerate(range(0, size, tile.size)):
            n = min(tile.size, size - start)
            shift = (2 * (t * 40503 + 1)) % tile.size
            self.data[start:start + n] = np.roll(tile, shift)[:n]
        self.size = size
        self.cursor = 0
        ssize = max(ALIGN, int(scale_size or size // 16))
        self.scales = rng.integers(120, 128, ssize, dtype=np.uint8)
        self.scursor = 0

    def take(self, shape, dtype: str) -> np.ndarray:
        """The next view of ``shape`` / ``dtype`` (aligned; wraps around; larger than the pool: an error)."""
        n = nbytes(shape, dtype)
        if n > self.size:
            raise ValueError(f"a {dtype}{list(shape)} tensor ({n / 2**20:.0f} MiB) does not fit the data pool "
                             f"({self.size / 2**20:.0f} MiB); raise --pool-mb")
        if self.cursor + n > self.size:
            self.cursor = 0
        v = self.data[self.cursor:self.cursor + n].view(TYPES[dtype][1]).reshape(shape)
        self.cursor = (self.cursor + n + ALIGN - 1) // ALIGN * ALIGN
        return v

    def take_scales(self, shape) -> np.ndarray:
        n = int(math.prod(shape))
        if n > self.scales.size:
            self.scales = np.random.default_rng(self.scales.size).integers(120, 128, n, dtype=np.uint8)
        if self.scursor + n > self.scales.size:
            self.scursor = 0
        v = self.scales[self.scursor:self.scursor + n].reshape(shape)
        self.scursor += n
        return v


# ---------------------------------------------------------------------------------------------------- graph


@dataclass
class Input:
    """One op input.

    kind:
      ``act``    graph input shared by every node copy (activations; hot in cache)
      ``weight`` per-node constant initializer taken from the pool (``scale``: from the scale pool)
      ``const``  one constant initializer shared by every node (``data`` given; small tables)
      ``state``  per-node graph input from the pool, updated in place when an output aliases it
      ``node``   per-node graph input whose value is ``data(i)`` for node copy i (e.g. distinct selections)
      ``absent`` an optional input left out
    """

    name: str
    kind: str
    shape: tuple = ()
    dtype: str = "float"
    data: np.ndarray | None = None


@dataclass
class NodeSpec:
    op: str
    domain: str
    inputs: list
    outputs: list  # (name, aliased input name or None, ONNX type name)
    attrs: dict = field(default_factory=dict)


def _value_info(name, dtype, shape):
    from onnx import helper

    return helper.make_tensor_value_info(name, TYPES[dtype][0], None if shape is None else list(shape))


def _external(name, dtype, shape):
    from onnx import TensorProto

    t = TensorProto()
    t.name = name
    t.data_type = TYPES[dtype][0]
    t.dims.extend(int(d) for d in shape)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "in-memory.bin"), ("offset", "0"), ("length", str(nbytes(shape, dtype)))):
        kv = t.external_data.add()
        kv.key, kv.value = k, v
    return t


class NodeGraph:
    """``n`` copies of one node in a session; :meth:`run` calls all of them once."""

    def __init__(self, spec: NodeSpec, n: int, pool: DataPool | None, *, threads: int, isa: str | None = None,
                 register_library: bool = True, opsets: dict | None = None):
        import onnxruntime as ort
        from onnx import helper

        import dsv4_ort

        self.spec, self.n = spec, n
        nodes, g_inputs, g_outputs, inits = [], [], [], []
        ext_names, ext_values = [], []
        self.arrays = [dict() for _ in range(n)]  # per node: input name -> numpy array (weights / state)
        self.shared = {}
        shared_done = set()
        self._keep = []
        for i in range(n):
            names = []
            for inp in spec.inputs:
                if inp.kind == "absent":
                    names.append("")
                    continue
                if inp.kind in ("act", "const"):
                    names.append(inp.name)
                    if inp.name in shared_done:
                        continue
                    shared_done.add(inp.name)
                    if inp.kind == "act":
                        g_inputs.append(_value_info(inp.name, inp.dtype, inp.data.shape))
                        self.shared[inp.name] = inp.data
                    else:
                        ext_names.append(inp.name)
                        inits.append(_external(inp.name, inp.dtype, inp.data.shape))
                        ext_values.append(self._ortvalue(inp.data, inp.dtype))
                    continue
                name = f"{inp.name}.{i}"
                names.append(name)
                if inp.kind == "scale":
                    arr = pool.take_scales(inp.shape)
                elif inp.kind == "node":
                    arr = np.ascontiguousarray(inp.data(i))
                else:
                    arr = pool.take(inp.shape, inp.dtype)
                self.arrays[i][inp.name] = arr
                if inp.kind in ("weight", "scale"):
                    ext_names.append(name)
                    inits.append(_external(name, inp.dtype, inp.shape))
                    ext_values.append(self._ortvalue(arr, inp.dtype))
                else:  # state / node
                    g_inputs.append(_value_info(name, inp.dtype, inp.shape))
            outs = [f"{o}.{i}" for o, _, _ in spec.outputs]
            nodes.append(helper.make_node(spec.op, names, outs, name=f"{spec.op}.{i}", domain=spec.domain,
                                          **spec.attrs))
            for o, (_, _, dtype) in zip(outs, spec.outputs):
                g_outputs.append(_value_info(o, dtype, None))
        graph = helper.make_graph(nodes, f"bench_{spec.op}", g_inputs, g_outputs, initializer=inits)
        ops = [helper.make_opsetid("", 21)]
        for dom, ver in (opsets or {}).items():
            ops.append(helper.make_opsetid(dom, ver))
        model = helper.make_model(graph, opset_imports=ops, ir_version=10)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        if ext_names:
            so.add_external_initializers(ext_names, ext_values)
        with dsv4_ort.isa_cap(isa):
            if register_library:
                dsv4_ort.register(so)
            self.session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.io = self.session.io_binding()
        self._values = {}
        for name, arr in list(self.shared.items()):
            self.bind_shared(name, arr)
        for i in range(n):
            for inp in spec.inputs:
                if inp.kind not in ("state", "node"):
                    continue
                v = self._ortvalue(self.arrays[i][inp.name], inp.dtype)
                self.io.bind_ortvalue_input(f"{inp.name}.{i}", v)
                self._values[f"{inp.name}.{i}"] = v
            for o, alias, _ in spec.outputs:
                if alias is not None:
                    self.io.bind_ortvalue_output(f"{o}.{i}", self._values[f"{alias}.{i}"])
                else:
                    self.io.bind_output(f"{o}.{i}", "cpu")

    def _ortvalue(self, arr: np.ndarray, dtype: str, keep: bool = True):
        import onnxruntime as ort

        arr = np.ascontiguousarray(arr)
        if keep:
            self._keep.append(arr)  # the OrtValue borrows the array's memory
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr, TYPES[dtype][0])

    def bind_shared(self, name: str, arr: np.ndarray):
        """(Re)binds a shared input, e.g. to rotate routing indices between runs."""
        dtype = next(i.dtype for i in self.spec.inputs if i.name == name)
        arr = np.ascontiguousarray(arr)
        v = self._ortvalue(arr, dtype, keep=False)
        self.io.bind_ortvalue_input(name, v)
        self._values[name] = v
        self.shared[name] = arr

    def run(self):
        self.session.run_with_iobinding(self.io)

    def outputs(self, i: int = 0) -> list:
        outs = self.io.get_outputs()
        k = len(self.spec.outputs)
        return [o.numpy() for o in outs[i * k:(i + 1) * k]]


__all__ = ["DataPool", "Input", "NodeSpec", "NodeGraph", "TYPES", "nbytes"]
