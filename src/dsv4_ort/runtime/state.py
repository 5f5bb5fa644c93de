"""Per-sequence state of an exported model: fixed-capacity buffers that stay in place.

Every state tensor listed in the model's ``dsv4_ort.json`` gets one buffer, allocated once per :class:`State` and
bound through IOBinding as both the ``past.L.name`` input and the ``present.L.name`` output, so the custom ops
write only the new slots (window ring entries, compressed entries, compressor rows) in place. Buffers start at
zero, which the ops treat as an empty sequence; ``positions`` holds each row's next absolute position.
"""

from __future__ import annotations

import numpy as np

from ..export.schema import ELEMENT_TYPES

# Element types a state tensor may have (names as the op table spells them); stored in numpy as the table says.
STATE_TYPES = ("float", "bfloat16", "float16", "float8e4m3fn", "uint8", "int64")


class State:
    """The state of ``batch_size`` sequences for one session (see :meth:`Session.new_state`)."""

    def __init__(self, meta: dict, batch_size: int, session=None):
        import onnxruntime as ort

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.max_seq_len = int(meta["max_seq_len"])
        self.positions = np.zeros(batch_size, np.int64)
        batch_dim = meta["state"]["batch_dim"]
        self.tensors = []  # (input name, output name, numpy buffer, OrtValue)
        for t in meta["state"]["tensors"]:
            if t["dtype"] not in STATE_TYPES:
                raise ValueError(f"state tensor {t['input']} has unsupported dtype {t['dtype']}")
            elem = ELEMENT_TYPES[t["dtype"]]
            np_dtype, onnx_type = np.dtype(elem.numpy), elem.code
            shape = [batch_size if d == batch_dim else int(d) for d in t["shape"]]
            buf = np.zeros(shape, np_dtype)
            value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(buf, onnx_type)
            self.tensors.append((t["input"], t["output"], buf, value))
        self.layout = [(t["input"], t["output"], t["dtype"], list(t["shape"])) for t in meta["state"]["tensors"]]
        self.binding = self.owner = None
        if session is not None:
            self.bind(session)
        self._run_buffers = ()

    def bind(self, session) -> None:
        """Binds this state to an onnxruntime session once: every state tensor as both past and present, and
        ``start_pos`` over ``positions`` itself (read at each run). Only input_ids and logits change shape, so only
        they are rebound per run, from buffers this object keeps alive until the next run (before onnxruntime 1.30
        a binding holds no reference to a numpy array it was given)."""
        import onnxruntime as ort

        binding = session.io_binding()
        self._start_pos = ort.OrtValue.ortvalue_from_numpy(self.positions)
        binding.bind_ortvalue_input("start_pos", self._start_pos)
        if any(i.name == "num_logits" for i in session.get_inputs()):  # a main graph exported with its MTP block
            self._num_logits = np.ones(1, np.int64)  # plain runs: the last position's logits (runtime/speculative.py)
            binding.bind_ortvalue_input("num_logits", ort.OrtValue.ortvalue_from_numpy(self._num_logits))
        for in_name, out_name, _, value in self.tensors:
            binding.bind_ortvalue_input(in_name, value)
            binding.bind_ortvalue_output(out_name, value)
        self.binding, self.owner = binding, session

    def rows(self, start: int, stop: int) -> "State":
        """A State over rows [start, stop) of this one that shares its memory: every buffer is the contiguous view
        ``buf[start:stop]`` (batch is the first dimension of every state tensor) and ``positions`` the view
        ``positions[start:stop]``, so a run on the view reads and advances exactly those rows of this state. The
        view has its own binding (bound to this state's session, if any); rows outside it are not touched."""
        import onnxruntime as ort

        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= self.batch_size):
            raise ValueError(f"rows [{start}, {stop}) are not a non-empty range of the {self.batch_size} rows")
        view = State.__new__(State)
        view.batch_size = stop - start
        view.max_seq_len = self.max_seq_len
        view.positions = self.positions[start:stop]
        view.tensors = []
        for (in_name, out_name, buf, _), (_, _, dtype, _) in zip(self.tensors, self.layout):
            rows = buf[start:stop]
            value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(rows, ELEMENT_TYPES[dtype].code)
            view.tensors.append((in_name, out_name, rows, value))
        view.layout = self.layout
        view.binding = view.owner = None
        view._run_buffers = ()
        view.parent = self  # the views' memory is this state's
        if self.owner is not None:
            view.bind(self.owner)
        return view

    def copy_row(self, src: int, dst: int) -> None:
        """Row ``dst`` becomes a copy of row ``src`` (every buffer and the position): the sequence moves rows."""
        if src == dst:
            return
        for _, _, buf, _ in self.tensors:
            buf[dst] = buf[src]
        self.positions[dst] = self.positions[src]

    def swap_rows(self, a: int, b: int) -> None:
        """Rows ``a`` and ``b`` exchange their sequences (every buffer and the position)."""
        if a == b:
            return
        for _, _, buf, _ in self.tensors:
            saved = buf[a].copy()
            buf[a] = buf[b]
            buf[b] = saved
        self.positions[[a, b]] = self.positions[[b, a]]

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for _, _, buf, _ in self.tensors)

    def reset(self) -> None:
        """Starts every row afresh (buffers are kept; stale contents are never read at position 0)."""
        self.positions[:] = 0

    def buffer(self, name: str) -> np.ndarray:
        """The numpy view of a state tensor (by its past/present name or its short ``L.name``)."""
        for i, o, buf, _ in self.tensors:
            if name in (i, o, i.removeprefix("past.")):
                return buf
        raise KeyError(name)
