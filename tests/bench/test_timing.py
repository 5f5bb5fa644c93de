"""bench/timing.py: the page-cache warm-up that both engines' timed runs start from."""

from dsv4_ort.bench.timing import warm_page_cache


def test_warm_page_cache_reads_every_byte_of_files_and_directories(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.onnx").write_bytes(b"x" * 1000)
    (d / "model.onnx.data").write_bytes(bytes(range(256)) * 40000)  # larger than one read chunk below
    (d / "sub").mkdir()  # directories inside are not descended into
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"g" * 12345)
    out = warm_page_cache(d, gguf, chunk=1 << 16)
    assert out["bytes"] == 1000 + 256 * 40000 + 12345
    assert out["seconds"] >= 0.0
