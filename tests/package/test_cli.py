"""The dsv4-ort command line, through subprocess as a user runs it."""

import json
import os
import subprocess
import sys

import pytest


def dsv4(*args, env=None):
    exe = os.path.join(os.path.dirname(sys.executable), "dsv4-ort")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **(env or {})))


def test_info():
    r = dsv4("info")
    assert r.returncode == 0, r.stderr
    assert "onnxruntime" in r.stdout and "isa:" in r.stdout and "moe_routing" in r.stdout
    assert "weight prefetch:" in r.stdout and "bf16 attention products:" in r.stdout


def test_info_json_and_isa_cap():
    r = dsv4("info", "--json", "--isa", "scalar")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["isa"] == "scalar" and set(info["families"].values()) == {"scalar"}


def test_env_cap_and_invalid_env():
    r = dsv4("info", "--json", env={"DSV4_ORT_ISA": "avx2"})
    assert r.returncode == 0 and json.loads(r.stdout)["isa"] in ("scalar", "avx2")
    r = dsv4("info", env={"DSV4_ORT_ISA": "neon"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "DSV4_ORT_ISA='neon'" in r.stderr and "scalar, avx2, avx512, amx" in r.stderr


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    return {"DSV4_ORT_CACHE": str(tmp_path_factory.mktemp("cache"))}


def test_run_exports_once_then_reuses(cache_env):
    r = dsv4("run", env=cache_env)
    assert r.returncode == 0, r.stderr
    assert "exporting the built-in demo model" in r.stderr
    assert "generated ids: [" in r.stdout and "tokens/s" in r.stdout and "isa: " in r.stdout
    # the built-in model carries DeepSeek-V4's tokenizer: its prompt and output are text
    assert "prompt: 'Hello' (ids [" in r.stdout
    text = [line for line in r.stdout.splitlines() if line.startswith("text: ")]
    assert text and len(text[0]) > len("text: ")
    again = dsv4("run", "--isa", "scalar", env=cache_env)
    assert again.returncode == 0, again.stderr
    assert "exporting" not in again.stderr and "isa: scalar" in again.stdout
    ids = lambda out: [line for line in out.splitlines() if line.startswith("generated ids")]  # noqa: E731
    assert ids(r.stdout) == ids(again.stdout)  # greedy, deterministic, same at every ISA level


def test_export_and_generate(tmp_path, cache_env):
    out = tmp_path / "m"
    r = dsv4("export", "--preset", "tiny", str(out), "--quiet", "--max-seq-len", "128")
    assert r.returncode == 0, r.stderr
    g = dsv4("generate", str(out), "--ids", "0,5,7", "--max-new-tokens", "6", "--quiet")
    assert g.returncode == 0, g.stderr
    assert len(g.stdout.split()) == 6
    s1 = dsv4("generate", str(out), "--ids", "0,5,7", "--max-new-tokens", "6", "--temperature", "1", "--seed", "3")
    s2 = dsv4("generate", str(out), "--ids", "0,5,7", "--max-new-tokens", "6", "--temperature", "1", "--seed", "3")
    assert s1.returncode == 0 and s1.stdout == s2.stdout
    bad = dsv4("generate", str(out), "--ids", "0,999999")
    assert bad.returncode == 2 and "outside the vocabulary" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    nomodel = dsv4("generate", str(tmp_path / "missing"), "--ids", "1")
    assert nomodel.returncode == 2 and "does not exist" in nomodel.stderr
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "model.onnx").write_bytes(b"\0garbage")
    (tmp_path / "corrupt" / "dsv4_ort.json").write_text((out / "dsv4_ort.json").read_text())
    corrupt = dsv4("generate", str(tmp_path / "corrupt"), "--ids", "1")
    assert corrupt.returncode == 2 and len(corrupt.stderr.strip().splitlines()) == 1
    notext = dsv4("generate", str(out), "--prompt", "hello")
    assert notext.returncode == 2 and "tokenizer" in notext.stderr


@pytest.mark.parametrize("args", [["bogus"], ["run", "--isa", "sse9"], ["info", "--unknown"], [],
                                  ["generate", "x"], ["generate", "x", "--ids", "1", "--prompt", "a"],
                                  ["generate", "x", "--ids", "a,b"], ["export"], ["run", "--checkpoint", "/nonexistent"]])
def test_bad_arguments_exit_2(args):
    r = dsv4(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)


# ---- bad input: exit status 2 and one line naming the argument or file (or the right behaviour) ---------------------

def cli(capsys, *args) -> tuple:
    """dsv4_ort.cli.main in this process: (status, stdout, stderr); argparse's exits included."""
    from dsv4_ort.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from dsv4_ort.export import export_model

    out = tmp_path_factory.mktemp("cli") / "m"
    export_model(None, out, preset="tiny", max_seq_len=128, logits="last", progress=False)
    return out


@pytest.mark.parametrize("text", ["1 2 3", "1, 2, 3", " 1\t2,3 ", "1,2,3,", "1 ,2  3"])
def test_ids_separated_by_spaces_or_commas(capsys, tiny_model, text):
    want = cli(capsys, "generate", str(tiny_model), "--ids", "1,2,3", "--max-new-tokens", "3", "--quiet")
    got = cli(capsys, "generate", str(tiny_model), "--ids", text, "--max-new-tokens", "3", "--quiet")
    assert want[0] == 0 and got == want


@pytest.mark.parametrize("args,names", [
    (["--ids", str(10**23)], "--ids"), (["--ids", "-1"], "--ids"), (["--ids", "1.5"], "--ids"),
    (["--ids", "1_000"], "--ids"), (["--ids", " , "], "--ids"), (["--ids", "512"], "--ids"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"), (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-0.5"], "--temperature"), (["--temperature", "inf"], "--temperature"),
    (["--top-p", "0"], "--top-p"), (["--top-p", "nan"], "--top-p"), (["--top-k", "-1"], "--top-k"),
    (["--seed", "-2"], "--seed"),
])
def test_generate_bad_values_exit_2(capsys, tiny_model, args, names):
    full = ["generate", str(tiny_model), *args] + ([] if "--ids" in args else ["--ids", "1,2"])
    code, out, err = cli(capsys, *full)
    assert code == 2 and names in one_line(err) and out == ""


@pytest.mark.parametrize("command,args", [(c, a) for c in ("run", "generate", "bench")
                                          for a in (["--max-new-tokens", "-1"], ["--threads", "-1"],
                                                    ["--threads", "5000"], ["--threads", "99999999"])
                                          if not (c == "bench" and a[0] == "--max-new-tokens")])
def test_counts_are_bounded_before_anything_runs(capsys, monkeypatch, command, args):
    """Checked by the parser: the command itself (which would start that many threads) never runs."""
    from dsv4_ort.bench import cli as bench_cli
    from dsv4_ort.runtime import cli as runtime_cli

    def never(*a, **k):
        raise AssertionError("the command ran")

    for mod, name in ((runtime_cli, "cmd_run"), (runtime_cli, "cmd_generate"), (bench_cli, "cmd_bench")):
        monkeypatch.setattr(mod, name, never)
    full = {"run": ["run"], "generate": ["generate", "x", "--ids", "1"], "bench": ["bench", "--smoke"]}[command]
    code, _, err = cli(capsys, *full, *args)
    assert code == 2 and args[0] in one_line(err)
    if args[1] == "5000":
        assert "1 .. " in err  # says the bound


def _no_torch_env(tmp_path) -> dict:
    fake = tmp_path / "notorch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named torch (hidden by the test)')\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")]))}


def test_paths_are_checked_before_the_torch_import(tmp_path, tiny_model):
    """Without torch: a missing checkpoint is named as such, and an exported model given to run --checkpoint runs
    (nothing to export)."""
    env = dict(_no_torch_env(tmp_path), DSV4_ORT_CACHE=str(tmp_path / "cache"))
    r = dsv4("export", str(tmp_path / "missing"), str(tmp_path / "out"), env=env)
    assert r.returncode == 2 and "does not exist" in one_line(r.stderr) and "torch" not in r.stderr
    r = dsv4("run", "--checkpoint", str(tmp_path / "missing"), env=env)
    assert r.returncode == 2 and "does not exist" in one_line(r.stderr) and "torch" not in r.stderr
    r = dsv4("run", "--checkpoint", str(tiny_model), "--max-new-tokens", "3", "--quiet", env=env)
    assert r.returncode == 0, r.stderr
    assert f"model: {tiny_model}" in r.stdout and "generated ids: [" in r.stdout
    assert not (tmp_path / "cache").exists()  # run as it is, not exported into the cache


def test_corrupt_tokenizer(capsys, tmp_path, tiny_model):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model, d)
    (d / "tokenizer.json").write_text("{not a tokenizer")
    code, out, err = cli(capsys, "generate", str(d), "--ids", "1 2", "--max-new-tokens", "3")
    assert code == 0 and len(out.split()) == 3  # ids need no tokenizer: token ids out, a warning naming the file
    assert "tokenizer.json" in err
    code, _, err = cli(capsys, "generate", str(d), "--prompt", "hello")
    assert code == 2 and str(d / "tokenizer.json") in one_line(err)
    code, _, err = cli(capsys, "run", "--checkpoint", str(d), "--quiet")
    assert code == 2 and str(d / "tokenizer.json") in one_line(err)


def test_bench_out_is_checked_before_running(capsys, tmp_path, monkeypatch):
    from dsv4_ort.bench import suite

    def never(*a, **k):
        raise AssertionError("the suite ran")

    monkeypatch.setattr(suite, "run", never)
    afile = tmp_path / "results"
    afile.write_text("x")
    for out in (afile, afile / "sub"):
        code, _, err = cli(capsys, "bench", "--smoke", "--quiet", "--out", str(out))
        assert code == 2 and "--out" in one_line(err) and str(out) in err
    code, _, err = cli(capsys, "bench", "--smoke", "--quiet", "--model-dir", str(tmp_path / "none"),
                       "--out", str(tmp_path / "fresh"))
    assert code == 2 and "--model-dir" in one_line(err)
    for bad in (["--serving-tokens", "8"], ["--serving-tokens", "8,16,32"], ["--serving-rounds", "0"],
                ["--serving-compute", "bf16", "--model-dir", str(tmp_path)]):
        code, _, err = cli(capsys, "bench", "--serving", "--quiet", *bad, "--out", str(tmp_path / "fresh"))
        assert code == 2 and bad[0] in one_line(err)


def test_bench_serving_options_reach_the_run(capsys, tmp_path, monkeypatch):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from dsv4_ort.bench import serving

    seen = {}

    def fake(preset, **kw):
        seen.update(kw, preset=preset)
        return {"preset": preset, "compute": kw["compute"], "machine": {"cpu": "x"}, "threads": 1, "max_batch": 16,
                "prompt_tokens": kw["prompt_tokens"], "max_tokens": kw["max_tokens"], "rows": []}

    monkeypatch.setattr(serving, "run", fake)
    code, out, _ = cli(capsys, "bench", "--serving", "--quiet", "--serving-tokens", "8,128", "--serving-compute",
                       "bf16", "--out", str(tmp_path / "o"))
    assert code == 0 and seen["preset"] == "bench" and seen["compute"] == "bf16" and seen["rounds"] == 2
    assert (seen["prompt_tokens"], seen["max_tokens"]) == (8, 128)
    code, _, _ = cli(capsys, "bench", "--serving", "--quiet", "--serving-rounds", "3", "--out", str(tmp_path / "p"))
    assert code == 0 and seen["rounds"] == 3
    assert "--compute bf16 export" in out and "prompt 8 tokens, 128 output tokens" in out


@pytest.mark.parametrize("exc,status", [(RuntimeError(), 1), (RuntimeError("\n  \n"), 1), (ValueError(""), 2),
                                        (OSError(), 1), (ValueError("first\nsecond"), 2)])
def test_error_handler_copes_with_any_message(capsys, monkeypatch, exc, status):
    from dsv4_ort.runtime import cli as runtime_cli

    def boom(args):
        raise exc

    monkeypatch.setattr(runtime_cli, "cmd_generate", boom)
    code, _, err = cli(capsys, "generate", "x", "--ids", "1")
    line = one_line(err)
    assert code == status and line.startswith("dsv4-ort generate: error: ")
    assert line.endswith(type(exc).__name__) or "second" in line


def test_ctrl_c_exits_130_with_one_line(capsys, monkeypatch, tmp_path):
    import sys
    import types

    class Interrupting(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt  # as if Ctrl-C came while the exporter's modules are imported

    monkeypatch.setitem(sys.modules, "dsv4_ort.export.exporter", Interrupting("dsv4_ort.export.exporter"))
    code, _, err = cli(capsys, "export", "--preset", "tiny", str(tmp_path / "out"), "--quiet")
    assert code == 130 and one_line(err) == "dsv4-ort export: interrupted"
    monkeypatch.undo()

    from dsv4_ort.runtime import cli as runtime_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime_cli, "cmd_generate", interrupted)
    code, _, err = cli(capsys, "generate", "x", "--ids", "1")
    assert code == 130 and one_line(err) == "dsv4-ort generate: interrupted"


def _junk_model(d):
    (d / "model.onnx").write_bytes(b"\0not a model")


def _truncated_data(d):
    with open(d / "model.onnx.data", "r+b") as f:
        f.truncate(1000)


def _no_meta(d):
    (d / "dsv4_ort.json").unlink()


def _meta_not_json(d):
    (d / "dsv4_ort.json").write_text("{")


def _no_data(d):
    (d / "model.onnx.data").unlink()


def _model_is_a_directory(d):
    (d / "model.onnx").unlink()
    (d / "model.onnx").mkdir()


def test_damaged_cache_entry_is_exported_again(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_ORT_CACHE", str(tmp_path / "cache"))
    code, first, _ = cli(capsys, "run", "--quiet", "--max-new-tokens", "4")
    assert code == 0
    (entry,) = [p for p in (tmp_path / "cache" / "models").iterdir() if not p.name.startswith(".")]
    ids = [line for line in first.splitlines() if line.startswith("generated ids")]
    for damage in (_junk_model, _truncated_data, _no_meta, _meta_not_json, _no_data, _model_is_a_directory):
        damage(entry)
        code, out, err = cli(capsys, "run", "--max-new-tokens", "4")
        assert code == 0, (damage.__name__, err)
        assert "exporting" in err, damage.__name__
        assert [line for line in out.splitlines() if line.startswith("generated ids")] == ids, damage.__name__
        code, out, err = cli(capsys, "run", "--max-new-tokens", "4")  # repaired: used as it is
        assert code == 0 and "exporting" not in err, damage.__name__


@pytest.mark.parametrize("command", ["export", "run"])
def test_fifo_in_the_checkpoint_is_an_error_not_a_hang(tmp_path, command):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text('{"model_type": "deepseek_v4"}')
    os.mkfifo(ck / "model.safetensors")
    args = ["export", str(ck), str(tmp_path / "out")] if command == "export" else ["run", "--checkpoint", str(ck)]
    exe = os.path.join(os.path.dirname(sys.executable), "dsv4-ort")
    r = subprocess.run([exe, *args], check=False, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, DSV4_ORT_CACHE=str(tmp_path / "cache")))
    assert r.returncode == 2 and str(ck / "model.safetensors") in one_line(r.stderr) and "FIFO" in r.stderr


def _write_tiny(path, seed):
    from dsv4_ort.models import DeepseekV4Config, write_random_checkpoint

    write_random_checkpoint(path, DeepseekV4Config.from_preset("tiny"), seed=seed)


def test_rewritten_checkpoint_is_exported_again(capsys, tmp_path, monkeypatch):
    """The cache key of `run --checkpoint` follows the weights, not the directory name: a checkpoint rewritten
    with other weights (same names, shapes and sizes, even with its time stamps put back) is exported again."""
    monkeypatch.setenv("DSV4_ORT_CACHE", str(tmp_path / "cache"))
    ck = tmp_path / "ck"
    _write_tiny(ck, seed=0)
    run = ("run", "--checkpoint", str(ck), "--max-new-tokens", "6")
    code, first, err = cli(capsys, *run)
    assert code == 0 and "exporting" in err, err
    code, again, err = cli(capsys, *run)
    assert code == 0 and "exporting" not in err and again.splitlines()[0] == first.splitlines()[0]
    times = {f.name: (f.stat().st_atime_ns, f.stat().st_mtime_ns) for f in ck.iterdir()}
    _write_tiny(ck, seed=1)
    for f in ck.iterdir():
        os.utime(f, ns=times[f.name])
    code, second, err = cli(capsys, *run)
    assert code == 0 and "exporting" in err, err
    ids = [[line for line in out.splitlines() if line.startswith("generated ids")] for out in (first, second)]
    assert ids[0] and ids[0] != ids[1]


def test_checkpoint_key_reads_samples_of_a_large_shard(tmp_path):
    """A shard larger than the sampled blocks: a change in a sampled block, the size or the header changes the
    key; the key reads the header and the samples, not the whole file."""
    from dsv4_ort.runtime.cli import SAMPLE_BYTES, SAMPLES, checkpoint_key

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "U8", "shape": [1 << 22], "data_offsets": [0, 1 << 22]}}).encode()
    shard = ck / "model.safetensors"
    shard.write_bytes(len(header).to_bytes(8, "little") + header + bytes(1 << 22))
    st = shard.stat()
    base = checkpoint_key(ck)
    assert checkpoint_key(ck) == base
    data_start = 8 + len(header)
    last_block = st.st_size - SAMPLE_BYTES  # the last sample ends at the end of the file
    with open(shard, "r+b") as fh:
        fh.seek(last_block + 7)
        fh.write(b"\x01")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = checkpoint_key(ck)
    assert changed != base
    (ck / "config.json").write_text('{"a": 1}')
    assert checkpoint_key(ck) not in (base, changed)
    assert SAMPLES * SAMPLE_BYTES < st.st_size - data_start  # the shard really is sampled, not read whole


def test_generate_streams_text_that_decodes_the_ids(tmp_path, capsys):
    """`generate --prompt` writes text as it is produced; the pieces add up to the decoded ids (no multi-byte
    character split between pieces: a split one would show as U+FFFD where the whole decode has none)."""
    from dsv4_ort.export import export_model
    from dsv4_ort.runtime import Session

    model = export_model(None, tmp_path / "demo", preset="demo", max_seq_len=128, progress=False).parent
    code, out, _ = cli(capsys, "generate", str(model), "--prompt", "数学 Grüße", "--max-new-tokens", "24", "--quiet")
    assert code == 0
    sess = Session(model, intra_op_threads=1)
    ids = sess.generate(sess.encode("数学 Grüße"), 24)
    assert out == sess.tokenizer.decode(ids, skip_special_tokens=False) + "\n"
