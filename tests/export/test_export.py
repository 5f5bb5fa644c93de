"""Exporter: exported random tiny checkpoints run in onnxruntime (with the custom-op library, state buffers shared
between past and present) and match the PyTorch reference loaded from the same checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from model_fixtures import REL_TOL, config, random_ids, reference_logits, rel_err, require_library

from dsv4_ort.export import schema

GLUE_OPS = {"Gather", "Cast", "Shape", "Reshape", "Unsqueeze", "Expand", "Slice", "Add"}


@pytest.fixture(scope="module", autouse=True)
def _library():
    require_library()


def _load(path):
    return onnx.load(str(path), load_external_data=False)


# ----------------------------------------------------------------------------------------------------- structure


def test_files_metadata_and_io_contract(cache):
    path = cache.export(("tiny",), logits="all")
    out = path.parent
    assert sorted(os.listdir(out)) == ["dsv4_ort.json", "model.onnx", "model.onnx.data"]
    m = _load(path)
    meta = json.loads((out / "dsv4_ort.json").read_text())
    props = {p.key: p.value for p in m.metadata_props}
    assert json.loads(props["dsv4_ort.json"]) == meta
    assert props["dsv4_ort.max_seq_len"] == "256" and props["dsv4_ort.logits"] == "all"
    cfg = config("tiny")
    assert meta["config"] == cfg.to_dict()
    assert meta["op_table_version"] == schema.TABLE_VERSION and meta["ort_api_version"] == schema.ORT_API_VERSION
    assert meta["weights"]["formats"]["linears"] == ["fp8"] and meta["weights"]["formats"]["routed_experts"] == ["fp4"]
    assert meta["tokenizer"] == {"present": False, "files": []} and meta["mtp"]["exported"] is False

    def sig(vi):
        t = vi.type.tensor_type
        return vi.name, t.elem_type, [d.dim_param or d.dim_value for d in t.shape.dim]

    ins, outs = [sig(v) for v in m.graph.input], [sig(v) for v in m.graph.output]
    assert ins[:2] == [("input_ids", 7, ["batch", "seq"]), ("start_pos", 7, ["batch"])]
    assert outs[0] == ("logits", 1, ["batch", "seq", cfg.vocab_size])
    # state: identical past/present signatures, geometry from the config
    assert [n[len("past."):] for n, _, _ in ins[2:]] == [n[len("present."):] for n, _, _ in outs[1:]]
    assert [(e, s) for _, e, s in ins[2:]] == [(e, s) for _, e, s in outs[1:]]
    shapes = {n: s for n, _, s in ins}
    D, cI, W = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    assert shapes["past.0.window"] == ["batch", W, D] and "past.0.entries" not in shapes
    assert shapes["past.1.entries"] == ["batch", 64, D] and shapes["past.1.kv_state"] == ["batch", 8, 2 * D]
    assert shapes["past.1.index_keys"] == ["batch", 64, cI]
    assert shapes["past.1.index_score_state"] == ["batch", 8, 2 * cI]
    assert shapes["past.2.entries"] == ["batch", 2, D] and shapes["past.2.score_state"] == ["batch", 128, D]
    assert "past.2.index_keys" not in shapes
    assert [t["input"] for t in meta["state"]["tensors"]] == [n for n, _, _ in ins[2:]]
    assert [lay["kind"] for lay in meta["state"]["layers"]] == ["swa", "csa", "hca", "csa"]


def test_checker_and_shape_inference_type_every_value(cache):
    path = cache.export(("tiny",), logits="last")
    schema.register_onnx_schemas()
    onnx.checker.check_model(str(path), full_check=True)
    m = _load(path)
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    typed = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output) +
             list(inferred.graph.input)}
    typed.update({t.name: t for t in inferred.graph.initializer})
    for node in inferred.graph.node:
        for name in list(node.input) + list(node.output):
            if not name:
                continue
            assert name in typed, f"{name} ({node.name}) has no type"
            v = typed[name]
            if isinstance(v, onnx.ValueInfoProto):
                assert v.type.tensor_type.elem_type != 0 and v.type.tensor_type.HasField("shape"), name

    # The declared shapes of standard-op outputs agree with what ONNX infers without them ...
    declared = {v.name: v for v in m.graph.value_info}
    std_outs = {o for n in m.graph.node if n.domain == "" for o in n.output}
    bare = onnx.ModelProto()
    bare.CopyFrom(m)
    del bare.graph.value_info[:]
    bare.graph.value_info.extend(v for k, v in declared.items() if k not in std_outs)
    got = {v.name: v for v in onnx.shape_inference.infer_shapes(bare, strict_mode=True).graph.value_info}
    for name in std_outs & set(declared):
        a, b = got[name].type.tensor_type, declared[name].type.tensor_type
        assert a.elem_type == b.elem_type, name
        for da, db in zip(a.shape.dim, b.shape.dim):  # inference may leave a dim unknown that we name
            if da.HasField("dim_value"):
                assert da.dim_value == db.dim_value, name

    # ... and those of our ops agree with the op table's shape rules (symbolic dims made concrete).
    dims = {"batch": 2, "seq": 3, "tokens": 6}
    shape_of = {v.name: [dims.get(d.dim_param, d.dim_value) for d in v.type.tensor_type.shape.dim]
                for v in list(m.graph.value_info) + list(m.graph.input) + list(m.graph.output)}
    shape_of.update({t.name: list(t.dims) for t in m.graph.initializer})
    n_custom = 0
    for node in m.graph.node:
        if node.domain != schema.DOMAIN:
            continue
        n_custom += 1
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        spec = schema.get(node.op_type)
        ins = [shape_of[n] if n else None for n in node.input] + [None] * (len(spec.inputs) - len(node.input))
        want = schema.infer_output_shapes(node.op_type, ins, attrs)
        assert [shape_of[o] for o in node.output] == want, node.name
    assert n_custom > 50


def test_node_census_and_naming(cache):
    m = _load(cache.export(("tiny",), logits="last"))
    std = {n.op_type for n in m.graph.node if n.domain == ""}
    assert std <= GLUE_OPS, std - GLUE_OPS
    assert {n.domain for n in m.graph.node} == {"", schema.DOMAIN}
    names = [n.name for n in m.graph.node]
    assert len(set(names)) == len(names) and all(names)
    assert {"layers.1.attn.compressor", "layers.1.attn.indexer.compressor", "layers.1.attn.indexer",
            "layers.1.attn.sparse_attention", "layers.0.ffn.route", "layers.3.ffn.experts", "hc_head",
            "logits.last_position"} <= set(names)
    ops = {n.name: n.op_type for n in m.graph.node}
    assert ops["layers.1.attn.wq_a"] == "LinearFp8" and ops["layers.1.ffn.experts"] == "MoeExpertsFp4"
    assert ops["layers.1.ffn.shared_experts"] == "MoeExpertsFp8" and ops["layers.0.ffn.route"] == "MoeRouteHash"
    assert ops["layers.2.ffn.route"] == "MoeRouteTopK" and ops["logits"] == "Linear"
    # bf16 tensors only reach data-movement standard ops
    types = {v.name: v.type.tensor_type.elem_type for v in list(m.graph.value_info) + list(m.graph.input)}
    types.update({t.name: t.data_type for t in m.graph.initializer})
    for n in m.graph.node:
        if n.domain == "" and n.op_type not in ("Gather", "Cast"):
            assert all(types.get(i) not in (onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT8E4M3FN)
                       for i in n.input), n.name


def test_initializers_are_external_aligned_and_stacked(cache):
    path = cache.export(("tiny",), logits="last")
    m = _load(path)
    cfg = config("tiny")
    size = os.path.getsize(path.parent / "model.onnx.data")
    regions = []
    inits = {t.name: t for t in m.graph.initializer}
    for t in m.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            assert t.name.startswith(("const.", "rope.")), t.name  # shape vectors and RoPE tables only
            continue
        info = {kv.key: kv.value for kv in t.external_data}
        assert info["location"] == "model.onnx.data"
        off, length = int(info["offset"]), int(info["length"])
        assert off % 4096 == 0 and off + length <= size
        regions.append((off, off + length))
    regions.sort()
    assert all(a[1] <= b[0] for a, b in zip(regions, regions[1:]))
    E, I, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    w1 = inits["layers.2.ffn.experts.w1.weight"]
    assert list(w1.dims) == [E, I, d // 2] and w1.data_type == onnx.TensorProto.UINT8
    assert list(inits["layers.2.ffn.experts.w2.scale"].dims) == [E, d, I // 32]
    assert list(inits["layers.2.ffn.shared_experts.w1.weight"].dims) == [1, I, d]
    assert inits["layers.2.ffn.shared_experts.w1.weight"].data_type == onnx.TensorProto.FLOAT8E4M3FN
    assert inits["embed.weight"].data_type == onnx.TensorProto.BFLOAT16
    assert inits["layers.0.attn.kv_norm.weight"].data_type == onnx.TensorProto.BFLOAT16
    assert inits["layers.0.hc_attn_fn"].data_type == onnx.TensorProto.FLOAT
    assert not any(n.startswith("mtp.") for n in inits)

    # A stacked expert slot holds exactly the checkpoint's expert tensor.
    from dsv4_ort.models.checkpoint import iter_checkpoint

    want = next(rt for rt in iter_checkpoint(cache.checkpoint("tiny"), raw=True)
                if rt.name == "layers.2.ffn.experts.5.w3.weight")
    t = inits["layers.2.ffn.experts.w3.weight"]
    info = {kv.key: kv.value for kv in t.external_data}
    slot = int(info["length"]) // E
    with open(path.parent / "model.onnx.data", "rb") as f:
        f.seek(int(info["offset"]) + 5 * slot)
        got = f.read(slot)
    assert got == want.data.numpy().tobytes()


@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_released_geometries_build_and_type_check(preset):
    """The full-size graphs (release formats, no weights) build and pass strict ONNX shape inference."""
    import math

    from dsv4_ort.export.graph import DecoderGraph, Weight, make_model
    from dsv4_ort.export.weights import Entry, external_initializer, stacked_name, tensor_role
    from dsv4_ort.models import deepseek_tensor_specs
    from dsv4_ort.models.config import DeepseekV4Config

    T = onnx.TensorProto
    cfg = DeepseekV4Config.from_preset(preset)
    w = {}
    for s in deepseek_tensor_specs(cfg):
        if s.name.startswith("mtp."):
            continue
        st = stacked_name(s.name)
        name, role = (st[0] if st else s.name), tensor_role(s.name)
        if role != "matrix":
            w[name] = Weight(name, T.INT64 if role == "index" else T.FLOAT, s.shape, role)
            continue
        pre = (cfg.n_routed_experts,) if st else (1,) if ".shared_experts." in s.name else ()
        sname = name[: -len(".weight")] + ".scale"
        if st:  # FP4 routed experts
            w[name] = Weight(name, T.UINT8, pre + (s.shape[0], s.shape[1] // 2), "fp4", sname, (1, 32))
            w[sname] = Weight(sname, T.UINT8, pre + (s.shape[0], s.shape[1] // 32), "scale")
        elif s.kind == "linear":  # FP8
            w[name] = Weight(name, T.FLOAT8E4M3FN, pre + s.shape, "fp8", sname, (128, 128))
            w[sname] = Weight(sname, T.UINT8, pre + tuple(math.ceil(n / 128) for n in s.shape), "scale")
        else:
            w[name] = Weight(name, T.BFLOAT16, s.shape, "bf16")
    g = DecoderGraph(cfg, w, max_seq_len=4096, logits="last").build()
    g.initializers.extend(external_initializer(Entry(n, x.dtype, x.dims, 0, 0), "x") for n, x in w.items())
    schema.register_onnx_schemas()
    m = onnx.shape_inference.infer_shapes(make_model(g, {}), strict_mode=True)
    assert sum(n.op_type == "SparseAttention" for n in m.graph.node) == cfg.num_hidden_layers
    assert sum(n.op_type == "Indexer" for n in m.graph.node) == cfg.layer_ratios.count(4)


# ----------------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("weights", ["native", "bf16", "fp32"])
def test_prefill_parity_weight_modes(cache, weights):
    """Full prefill of 140 tokens (crossing the first HCA-128 entry) with logits of every position."""
    m = cache.ort(cache.export(("tiny",), weights=weights, logits="all"), threads=2 if weights == "native" else 1)
    ids = random_ids(config("tiny").vocab_size, (1, 140), seed=1)
    got = m.run(ids, np.zeros(1, np.int64), m.new_state(1))
    ref = reference_logits(cache.reference(("tiny",)), ids)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < REL_TOL


@pytest.mark.parametrize("ck", [("tiny", "hf", "native"), ("fast", "deepseek", "fp8")],
                         ids=["hf-naming-native", "fp8-experts"])
def test_prefill_parity_checkpoint_formats(cache, ck):
    m = cache.ort(cache.export(ck, logits="all", max_seq_len=128))
    ids = random_ids(config(ck[0]).vocab_size, (1, 45), seed=2)
    got = m.run(ids, np.zeros(1, np.int64), m.new_state(1))
    assert rel_err(got, reference_logits(cache.reference(ck), ids)) < REL_TOL


def test_both_namings_export_identical_models(cache):
    ids = random_ids(config("tiny").vocab_size, (1, 30), seed=3)
    a = cache.ort(cache.export(("tiny", "deepseek", "native"), logits="all"))
    b = cache.ort(cache.export(("tiny", "hf", "native"), logits="all"))
    np.testing.assert_array_equal(a.run(ids, [0], a.new_state(1)), b.run(ids, [0], b.new_state(1)))


def test_token_by_token_decode(cache):
    ck = ("fast", "hf", "native")
    m = cache.ort(cache.export(ck, logits="last", max_seq_len=128))
    ids = random_ids(config("fast").vocab_size, (1, 56), seed=4)
    ref = reference_logits(cache.reference(ck), ids)
    st = m.new_state(1)
    prompt = 5
    errs = [rel_err(m.run(ids[:, :prompt], [0], st)[:, 0], ref[:, prompt - 1])]
    for p in range(prompt, ids.shape[1]):
        errs.append(rel_err(m.run(ids[:, p: p + 1], [p], st)[:, 0], ref[:, p]))
    assert max(errs) < REL_TOL, np.argmax(errs)


def test_chunked_prefill_across_compress_boundaries(cache):
    ck = ("fast", "hf", "native")
    m = cache.ort(cache.export(ck, logits="all", max_seq_len=128))
    ids = random_ids(config("fast").vocab_size, (1, 75), seed=5)
    ref = reference_logits(cache.reference(ck), ids)
    st = m.new_state(1)
    pos = 0
    for n in (3, 1, 14, 17, 2, 31, 7):  # boundaries of 4 and 16 fall inside and at the edges of chunks
        got = m.run(ids[:, pos: pos + n], [pos], st)
        assert rel_err(got, ref[:, pos: pos + n]) < REL_TOL, (pos, n)
        pos += n
    assert pos == ids.shape[1]


def test_chunked_prefill_hca128(cache):
    """Real geometry: the first 128-token HCA entry is emitted inside a chunk, then used by decode."""
    m = cache.ort(cache.export(("tiny",), logits="last"))
    ids = random_ids(config("tiny").vocab_size, (1, 134), seed=6)
    ref = reference_logits(cache.reference(("tiny",)), ids)
    st = m.new_state(1)
    assert rel_err(m.run(ids[:, :100], [0], st)[:, 0], ref[:, 99]) < REL_TOL
    assert rel_err(m.run(ids[:, 100:130], [100], st)[:, 0], ref[:, 129]) < REL_TOL
    for p in range(130, 134):
        assert rel_err(m.run(ids[:, p: p + 1], [p], st)[:, 0], ref[:, p]) < REL_TOL


def test_batch_of_two_rows_at_different_positions(cache):
    ck = ("fast", "hf", "native")
    m = cache.ort(cache.export(ck, logits="all", max_seq_len=128))
    ref_model = cache.reference(ck)
    V = config("fast").vocab_size
    seqs = [random_ids(V, (1, 11 + 12), seed=7), random_ids(V, (1, 30 + 12), seed=8)]
    prompts = [11, 30]
    refs = [reference_logits(ref_model, s)[0] for s in seqs]
    # each row's prompt alone (batch 1), then the two states stacked into one batch-2 state
    rows = []
    for s, n in zip(seqs, prompts):
        st = m.new_state(1)
        m.run(s[:, :n], [0], st)
        rows.append(st)
    st = {k: np.ascontiguousarray(np.concatenate([rows[0][k], rows[1][k]])) for k in rows[0]}
    pos = np.array(prompts, np.int64)
    # a 5-token chunk for both rows at their own positions, then 7 decode steps
    chunk = np.concatenate([s[:, n: n + 5] for s, n in zip(seqs, prompts)])
    got = m.run(chunk, pos, st)
    for b in range(2):
        assert rel_err(got[b], refs[b][prompts[b]: prompts[b] + 5]) < REL_TOL
    pos += 5
    for _ in range(7):
        tok = np.stack([seqs[b][0, pos[b]] for b in range(2)])[:, None]
        got = m.run(tok, pos, st)
        for b in range(2):
            assert rel_err(got[b, 0], refs[b][pos[b]]) < REL_TOL
        pos += 1


def test_greedy_continuation_matches_reference(cache):
    """24 greedy tokens decoded in onnxruntime; at every step the reference's argmax over the same prefix (one
    full forward of prompt + continuation) picks the same token, so the greedy continuations are identical."""
    ck = ("fast", "hf", "native")
    m = cache.ort(cache.export(ck, logits="last", max_seq_len=128))
    prompt = random_ids(config("fast").vocab_size, (1, 9), seed=9)
    n_new = 24
    st = m.new_state(1)
    logits = m.run(prompt, [0], st)
    ours = []
    for i in range(n_new):
        ours.append(int(np.argmax(logits[0, -1])))
        logits = m.run(np.array([ours[-1:]]), [prompt.shape[1] + i], st)
    seq = np.concatenate([prompt, np.array([ours])], axis=1)
    ref = reference_logits(cache.reference(ck), seq)[0, prompt.shape[1] - 1: -1]
    assert ref.argmax(-1).tolist() == ours
    top2 = np.sort(ref, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-3  # no near-tie that float32 noise could flip


def test_random_preset_export_matches_random_checkpoint(cache, tmp_path):
    """export_model(None, preset=...) streams the same weights write_random_checkpoint writes."""
    from dsv4_ort.export import export_model

    path = export_model(None, tmp_path / "preset", preset="tiny", logits="all", max_seq_len=256, progress=False)
    a = cache.ort(path)
    b = cache.ort(cache.export(("tiny",), logits="all"))
    ids = random_ids(config("tiny").vocab_size, (1, 12), seed=10)
    np.testing.assert_array_equal(a.run(ids, [0], a.new_state(1)), b.run(ids, [0], b.new_state(1)))
    assert json.loads((path.parent / "dsv4_ort.json").read_text())["source"]["preset"] == "tiny"


_NO_TORCH_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    for name in ("torch", "safetensors", "onnxscript", "tqdm", "transformers"):
        sys.modules[name] = None  # importing any of them raises ImportError
    import numpy as np
    import onnxruntime as ort
    import dsv4_ort
    from dsv4_ort.export import export_model
    out = sys.argv[1]
    ids = np.load(sys.argv[2])
    seconds = {}
    for weights in ("native", "bf16", "fp32"):
        t0 = time.perf_counter()
        export_model(None, os.path.join(out, weights), preset="tiny", weights=weights, logits="all", max_seq_len=256,
                     progress=weights == "native")  # the progress bar is optional (tqdm is blocked)
        seconds[weights] = time.perf_counter() - t0

    # onnxruntime + the installed custom-op library, every state buffer bound as both past and present
    meta = json.load(open(os.path.join(out, "native", "dsv4_ort.json")))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.register_custom_ops_library(dsv4_ort.get_library_path())
    sess = ort.InferenceSession(os.path.join(out, "native", "model.onnx"), so, providers=["CPUExecutionProvider"])
    io = sess.io_binding()
    io.bind_cpu_input("input_ids", ids)
    io.bind_cpu_input("start_pos", np.zeros(1, np.int64))
    for t in meta["state"]["tensors"]:
        v = ort.OrtValue.ortvalue_from_numpy(np.zeros([1] + t["shape"][1:], np.float32))
        io.bind_ortvalue_input(t["input"], v)
        io.bind_ortvalue_output(t["output"], v)
    io.bind_output("logits", "cpu")
    sess.run_with_iobinding(io)
    np.save(os.path.join(out, "logits.npy"), io.copy_outputs_to_cpu()[-1])

    # `dsv4-ort run`: export the built-in model into an empty cache, load it with the runtime, generate
    from dsv4_ort import cli
    os.environ["DSV4_ORT_CACHE"] = os.path.join(out, "cache")
    t0 = time.perf_counter()
    rc = cli.main(["run", "--threads", "1", "--max-new-tokens", "8", "--quiet"])
    seconds["run"] = time.perf_counter() - t0
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "safetensors", "onnxscript", "tqdm")
                    and sys.modules[m] is not None)
    print(json.dumps({"seconds": seconds, "run_rc": rc, "loaded": loaded}))
""")


def test_preset_export_and_run_without_torch(cache, tmp_path):
    """With torch (and safetensors, onnxscript, tqdm) unimportable, a preset exports in every weight mode, runs in
    onnxruntime with the library, matches the PyTorch reference on the same weights, and `dsv4-ort run` works."""
    ids = random_ids(config("tiny").vocab_size, (1, 140), seed=1)  # crosses the first HCA-128 entry
    np.save(tmp_path / "ids.npy", ids)
    out = subprocess.run([sys.executable, "-c", _NO_TORCH_SCRIPT, str(tmp_path), str(tmp_path / "ids.npy")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["run_rc"] == 0 and report["loaded"] == []
    assert "generated ids: [" in out.stdout
    print("export without torch, seconds:", report["seconds"])
    # the same weights as the random checkpoint the reference is loaded from, in every mode
    from dsv4_ort.export.files import TRAILER_SIZE

    for weights in ("native", "bf16", "fp32"):  # equal but for the export id ending each data file
        ours = (tmp_path / weights / "model.onnx.data").read_bytes()
        ref = (cache.export(("tiny",), weights=weights, logits="all").parent / "model.onnx.data").read_bytes()
        assert ours[:-TRAILER_SIZE] == ref[:-TRAILER_SIZE] and ours[-TRAILER_SIZE:] != ref[-TRAILER_SIZE:]
    got = np.load(tmp_path / "logits.npy")
    ref = reference_logits(cache.reference(("tiny",)), ids)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < REL_TOL


def test_tokenizer_files_are_copied(cache, tmp_path):
    import shutil

    from dsv4_ort.export import export_model

    ck = tmp_path / "ck"
    shutil.copytree(cache.checkpoint("fast", "deepseek", "fp8"), ck)
    (ck / "tokenizer.json").write_text('{"version": "1.0"}')
    (ck / "tokenizer_config.json").write_text("{}")
    path = export_model(ck, tmp_path / "out", max_seq_len=128, progress=False)
    assert (path.parent / "tokenizer.json").read_text() == '{"version": "1.0"}'
    meta = json.loads((path.parent / "dsv4_ort.json").read_text())
    assert meta["tokenizer"] == {"present": True, "files": ["tokenizer.json", "tokenizer_config.json"]}


# ----------------------------------------------------------------------------------------------------- memory


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import dsv4_ort.export.exporter, torch, onnx, tqdm.auto  # imported before the baseline
    from dsv4_ort.export import export_model
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    export_model(sys.argv[1], sys.argv[2], weights=sys.argv[3], max_seq_len=128, progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_kib": peak - base}))
""")


def test_peak_memory_is_bounded_by_the_largest_tensor(cache, tmp_path):
    """Exporting a checkpoint several times larger than the budget grows the RSS by about one tensor."""
    from dsv4_ort.models import deepseek_tensor_specs, write_random_checkpoint

    cfg = config("fast").replace(n_routed_experts=32, moe_intermediate_size=128, vocab_size=1024)
    ck = tmp_path / "ck"
    write_random_checkpoint(ck, cfg, weights="bf16")  # one shard: its memory map is open during the whole export
    ck_bytes = sum(f.stat().st_size for f in ck.glob("*.safetensors"))
    largest = max(4 * int(np.prod(s.shape)) for s in deepseek_tensor_specs(cfg))  # as float32
    # fp32 output: the stacked [E, ...] expert tensors (4 MiB each) are never held, only one expert at a time
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(ck), str(tmp_path / "out"), "fp32"],
                         capture_output=True, text=True, check=True, cwd=tmp_path)
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth_kib"] * 1024
    data = os.path.getsize(tmp_path / "out" / "model.onnx.data")
    budget = 4 * largest + 12 * 2**20  # measured: ~7 MiB with a 1 MiB largest tensor
    assert data > 3 * budget and ck_bytes > 2 * budget, (data, ck_bytes, budget)
    assert growth < budget, f"RSS grew {growth / 2**20:.1f} MiB; largest tensor {largest / 2**20:.1f} MiB"
