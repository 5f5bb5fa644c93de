"""Corrupt safetensors shards: whatever the bytes, reading a shard either works or raises a CheckpointError naming
the file (never a TypeError / AttributeError from a crafted header, never data read from outside the tensor's
bytes)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import dsv4_ort.models as C

TENSORS = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
           "c": torch.tensor([7, 8], dtype=torch.int64)}


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("shard") / "s.safetensors"
    save_file(TENSORS, str(path))
    return path.read_bytes()


def read_all(path) -> dict:
    with C.ShardReader(str(path)) as r:
        return {name: r.get(name) for name in r.header}


def with_header(shard: bytes, header) -> bytes:
    """The shard's data behind a new JSON header."""
    (n,) = struct.unpack("<Q", shard[:8])
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + shard[8 + n:]


def header_of(shard: bytes) -> dict:
    (n,) = struct.unpack("<Q", shard[:8])
    return json.loads(shard[8:8 + n])


def test_valid_shard_reads(shard, tmp_path):
    p = tmp_path / "s.safetensors"
    p.write_bytes(shard)
    got = read_all(p)
    for name, t in TENSORS.items():
        assert torch.equal(got[name], t)


@pytest.mark.parametrize("entry, match", [
    (5, "malformed header entry"),
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": ["0", "24"]}, "malformed header entry"),
    ({"dtype": "F32", "shape": None, "data_offsets": [0, 24]}, "malformed header entry"),
    ({"dtype": "F32", "shape": [-2, -3], "data_offsets": [0, 24]}, "malformed header entry"),
    ({"dtype": "F32", "shape": [True, 6], "data_offsets": [0, 24]}, "malformed header entry"),
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24, 30]}, "malformed header entry"),
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0.0, 24.0]}, "malformed header entry"),
    ({"dtype": 1, "shape": [2, 3], "data_offsets": [0, 24]}, "malformed header entry"),
    ({"shape": [2, 3], "data_offsets": [0, 24]}, "malformed header entry"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, "malformed header entry"),  # would read the header
    ({"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}, "end before they begin"),
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 10 ** 6]}, "truncated shard"),
    ({"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 24]}, "header size mismatch"),
    ({"dtype": "Q9", "shape": [2, 3], "data_offsets": [0, 24]}, "unsupported safetensors dtype"),
])
def test_malformed_header_entry(shard, tmp_path, entry, match):
    header = header_of(shard)
    header["a"] = entry
    p = tmp_path / "s.safetensors"
    p.write_bytes(with_header(shard, header))
    with pytest.raises(C.CheckpointError, match=match) as e:
        read_all(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("raw, match", [
    (b"", "no header"),
    (struct.pack("<Q", 2 ** 63), "truncated shard: header of"),
    (struct.pack("<Q", 4) + b"\xff\xfe{}", "unreadable safetensors header"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    (struct.pack("<Q", 5) + b'{"a":', "unreadable safetensors header"),
])
def test_malformed_header(tmp_path, raw, match):
    p = tmp_path / "s.safetensors"
    p.write_bytes(raw)
    with pytest.raises(C.CorruptCheckpointError, match=match):
        read_all(p)


def _outcome(path):
    try:
        read_all(path)
    except C.CheckpointError as e:
        assert str(path) in str(e)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_byte_corruption(shard, tmp_path, data):
    """Flipped bytes anywhere (length prefix, JSON, data) or a truncation: a CheckpointError or a clean read."""
    buf = bytearray(shard)
    if data.draw(st.booleans()):
        buf = buf[:data.draw(st.integers(0, len(buf)))]
    for _ in range(data.draw(st.integers(1, 8))):
        if buf:
            buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    p = tmp_path / "s.safetensors"
    p.write_bytes(bytes(buf))
    _outcome(p)


_json = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 64, 2 ** 64) | st.floats() | st.text(max_size=4),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
                     max_leaves=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_header_values(shard, tmp_path, data):
    """Header fields replaced by arbitrary JSON values: a CheckpointError or a clean read."""
    header = header_of(shard)
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(sorted(header)))
        if name == "__metadata__" or not isinstance(header[name], dict) or data.draw(st.booleans()):
            header[name] = data.draw(_json)
        else:
            header[name][data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = data.draw(_json)
    p = tmp_path / "s.safetensors"
    p.write_bytes(with_header(shard, header))
    _outcome(p)


def test_fifo_in_place_of_a_shard_is_an_error_not_a_hang(tmp_path):
    import os
    import threading

    from dsv4_ort.models import DeepseekV4Config, write_random_checkpoint

    write_random_checkpoint(tmp_path, DeepseekV4Config.from_preset("tiny"), seed=0)
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    result = {}

    def read():
        try:
            list(C.iter_checkpoint(tmp_path))
        except C.CheckpointError as e:
            result["error"] = e

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=60)
    if t.is_alive():  # unblock the reader before failing
        with open(shard, "wb"):
            pass
        pytest.fail("reading a checkpoint with a FIFO shard blocked")
    assert "not a regular file" in str(result["error"]) and shard.name in str(result["error"])
