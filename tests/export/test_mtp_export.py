"""Export with the MTP block (export/mtp.py): mtp.onnx beside model.onnx sharing its data file, the main graph's
extra I/O (hidden, num_logits), and parity of both graphs with the PyTorch reference (full prefill, chunked and
token-by-token MTP state, rows at different positions)."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from model_fixtures import REL_TOL, one_torch_thread, random_ids, rel_err, require_library

from dsv4_ort.export import schema


@pytest.fixture(scope="module")
def exported(cache, tmp_path_factory):
    """A random tiny checkpoint exported twice: plain, and with its MTP block drafting with the main head (the
    reference's MTP logits; the default FP4 draft head is tested in test_fp4_draft_head)."""
    from dsv4_ort.export import export_model

    require_library()
    ck = cache.checkpoint("tiny")
    root = tmp_path_factory.mktemp("mtp")
    mtp = export_model(ck, root / "mtp", max_seq_len=256, logits="last", mtp=True, mtp_head="shared",
                       progress=False)
    plain = cache.export(("tiny",), logits="last", max_seq_len=256)
    return plain, mtp


class Run:
    """Both graphs of an MTP export in onnxruntime with in-place state (IOBinding of the numpy buffers)."""

    def __init__(self, model_path):
        import onnxruntime as ort

        import dsv4_ort

        self.dir = model_path.parent
        self.meta = json.loads((self.dir / "dsv4_ort.json").read_text())
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.log_severity_level = 3
        dsv4_ort.register(so)
        self.main = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        self.mtp = ort.InferenceSession(str(self.dir / self.meta["mtp"]["graph"]), so,
                                        providers=["CPUExecutionProvider"])

    def state(self, tensors, batch):
        return {t["input"]: np.zeros([batch] + t["shape"][1:], np.float32) for t in tensors}

    def _run(self, sess, tensors, feeds, state, outputs):
        import onnxruntime as ort

        io = sess.io_binding()
        for k, v in feeds.items():
            io.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)))
        for t in tensors:
            v = ort.OrtValue.ortvalue_from_numpy(state[t["input"]])
            io.bind_ortvalue_input(t["input"], v)
            io.bind_ortvalue_output(t["output"], v)
        for o in outputs:
            io.bind_output(o, "cpu")
        sess.run_with_iobinding(io)
        return io.copy_outputs_to_cpu()[-len(outputs):]

    def main_run(self, ids, pos, state, n):
        return self._run(self.main, self.meta["state"]["tensors"],
                         {"input_ids": ids.astype(np.int64), "start_pos": np.asarray(pos, np.int64),
                          "num_logits": np.array([n], np.int64)}, state, ["logits", "hidden"])

    def mtp_run(self, hidden, ids, pos, state, n):
        return self._run(self.mtp, self.meta["mtp"]["state"]["tensors"],
                         {"hidden": hidden.astype(np.float32), "input_ids": ids.astype(np.int64),
                          "start_pos": np.asarray(pos, np.int64), "num_logits": np.array([n], np.int64)}, state,
                         ["logits", "hidden_out"])


def _reference(model, ids):
    """Reference main logits, streams and MTP logits (h_t with token t+1 -> token t+2) of a full prefill."""
    import torch

    with torch.no_grad(), one_torch_thread():
        t = torch.as_tensor(ids)
        logits, hidden = model(t, return_hidden=True)
        mtp = model.forward_mtp(hidden[:, :-1], t[:, 1:])
    return logits.numpy(), hidden.numpy(), mtp.numpy()


def test_files_metadata_and_graph_contract(exported):
    plain, path = exported
    out = path.parent
    assert sorted(os.listdir(out)) == ["dsv4_ort.json", "model.onnx", "model.onnx.data", "mtp.onnx"]
    meta = json.loads((out / "dsv4_ort.json").read_text())
    m = meta["mtp"]
    assert m["exported"] and m["graph"] == "mtp.onnx" and m["layer"] == 4 and m["kind"] == "swa"
    assert m["main_inputs"] == ["num_logits"] and m["main_outputs"] == ["hidden"]
    assert [t["input"] for t in m["state"]["tensors"]] == ["past.4.window"]
    assert json.loads((plain.parent / "dsv4_ort.json").read_text())["mtp"]["exported"] is False
    g = onnx.load(str(out / "mtp.onnx"), load_external_data=False).graph
    assert [i.name for i in g.input] == ["hidden", "input_ids", "start_pos", "num_logits", "past.4.window"]
    assert [o.name for o in g.output] == ["logits", "hidden_out", "present.4.window"]
    # shares the main data file: embedding and head at the same offsets, MTP tensors written there too
    def locations(graph):
        return {t.name: {e.key: e.value for e in t.external_data} for t in graph.initializer if t.external_data}

    mloc, gloc = locations(onnx.load(str(path), load_external_data=False).graph), locations(g)
    assert {v["location"] for v in gloc.values()} == {"model.onnx.data"}
    for name in ("embed.weight", "head.weight"):
        assert gloc[name] == mloc[name]
    assert all(n.startswith("mtp.0.") or n in ("embed.weight", "head.weight") for n in gloc)
    assert "mtp.0.ffn.experts.w1.weight" in gloc and "mtp.0.e_proj.weight" in gloc
    schema.register_onnx_schemas()
    onnx.checker.check_model(str(out / "mtp.onnx"), full_check=True)


def test_main_graph_with_mtp_gives_the_plain_logits(exported, cache):
    """The extra output and the num_logits slice change nothing in the main model's logits (bitwise)."""
    plain, path = exported
    r = Run(path)
    ids = random_ids(512, (2, 23), seed=3)
    st = r.state(r.meta["state"]["tensors"], 2)
    logits, hidden = r.main_run(ids, [0, 0], st, 1)
    want = cache.ort(plain).run(ids, [0, 0], cache.ort(plain).new_state(2))
    np.testing.assert_array_equal(logits, want)
    assert hidden.shape == (2, 23, 4, 256)


def test_prefill_parity_with_the_reference(exported, cache):
    """Main logits of every position (num_logits = seq), the streams, and the MTP logits on them."""
    _, path = exported
    r = Run(path)
    ids = random_ids(512, (2, 40), seed=5)
    ref_logits, ref_hidden, ref_mtp = _reference(cache.reference(("tiny",)), ids)
    st = r.state(r.meta["state"]["tensors"], 2)
    logits, hidden = r.main_run(ids, [0, 0], st, 40)
    assert rel_err(logits, ref_logits) < REL_TOL and rel_err(hidden, ref_hidden) < REL_TOL
    ms = r.state(r.meta["mtp"]["state"]["tensors"], 2)
    mtp_logits, mtp_hidden = r.mtp_run(hidden[:, :-1], ids[:, 1:], [0, 0], ms, 39)
    assert mtp_logits.shape == (2, 39, 512) and mtp_hidden.shape == (2, 39, 4, 256)
    assert rel_err(mtp_logits, ref_mtp) < REL_TOL
    # the window ring holds the last 16 positions' kv, the reference's state after the same prefill
    import torch

    model = cache.reference(("tiny",))
    with torch.no_grad(), one_torch_thread():
        rs = model.new_state(2, 256)
        t = torch.as_tensor(ids)
        _, h = model(t, state=rs, return_hidden=True)
        model.forward_mtp(h[:, :-1], t[:, 1:], state=rs)
    assert rel_err(ms["past.4.window"], rs.mtp[0].window.numpy()) < REL_TOL


def test_mtp_decode_token_by_token_and_rows_at_different_positions(exported, cache):
    """The MTP state carries over calls: chunks of 7, 1, 1, ... equal the full prefill, for two rows whose positions
    differ (row 1 starts 5 positions later, past the 16-slot window several times)."""
    _, path = exported
    r = Run(path)
    ids = random_ids(512, (2, 45), seed=7)
    _, hidden_full, ref = _reference(cache.reference(("tiny",)), ids)
    ms = r.state(r.meta["mtp"]["state"]["tensors"], 2)
    # row 0 at t, row 1 at t + 5: feed the row-1 sequence shifted by 5 positions
    starts = [0, 5]
    got = [[], []]
    pos = 0
    for step in [7] + [1] * 20 + [3] * 3:
        hid = np.stack([hidden_full[b, starts[b] + pos: starts[b] + pos + step] for b in range(2)])
        nxt = np.stack([ids[b, starts[b] + pos + 1: starts[b] + pos + step + 1] for b in range(2)])
        lg, _ = r.mtp_run(hid, nxt, [starts[0] + pos, starts[1] + pos], ms, step)
        for b in range(2):
            got[b].append(lg[b])
        pos += step
    for b in range(2):
        g = np.concatenate(got[b])
        want = ref[b, starts[b]: starts[b] + pos]
        if b == 1:  # positions 0..4 of row 1 were never fed: only queries past the window see a full history
            g, want = g[16:], want[16:]
        assert rel_err(g, want) < REL_TOL, b


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_requantised_draft_head(exported, cache, tmp_path, fmt):
    """The default draft head: mtp.onnx reads its own FP4 / FP8 copy of the head (E8M0 block scales) instead of the
    main head, the main graph is unchanged (bitwise), and the MTP logits stay close to the exact head's (the copy is
    requantised from the exact weights: mostly the same argmax)."""
    from dsv4_ort.export import export_model
    from dsv4_ort.export.mtp import DRAFT_HEAD

    shared_path = exported[1]
    path = export_model(cache.checkpoint("tiny"), tmp_path / fmt, max_seq_len=256, logits="last", mtp=True,
                        mtp_head=fmt, progress=False)
    g = onnx.load(str(path.parent / "mtp.onnx"), load_external_data=False).graph
    names = {t.name: t for t in g.initializer}
    assert DRAFT_HEAD in names and "head.weight" not in names
    assert names[DRAFT_HEAD].data_type == (onnx.TensorProto.UINT8 if fmt == "fp4" else onnx.TensorProto.FLOAT8E4M3FN)
    ids = random_ids(512, (2, 30), seed=9)
    runs = [Run(p) for p in (shared_path, path)]
    out = []
    for r in runs:
        logits, hidden = r.main_run(ids, [0, 0], r.state(r.meta["state"]["tensors"], 2), 30)
        mtp_logits, _ = r.mtp_run(hidden[:, :-1], ids[:, 1:], [0, 0], r.state(r.meta["mtp"]["state"]["tensors"], 2),
                                  29)
        out.append((logits, mtp_logits))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    exact, draft = out[0][1], out[1][1]
    assert rel_err(draft, exact) < (0.18 if fmt == "fp4" else 0.05), rel_err(draft, exact)
    assert (draft.argmax(-1) == exact.argmax(-1)).mean() > (0.65 if fmt == "fp4" else 0.9)  # random logits: near-ties


def test_export_arguments(cache, tmp_path):
    from dsv4_ort.export import export_model
    from dsv4_ort.export.exporter import ExportError

    with pytest.raises(ExportError, match="mtp_head must be 'shared', 'fp8' or 'fp4'"):
        export_model(None, tmp_path / "f", preset="tiny", mtp=True, mtp_head="int4", progress=False)
    with pytest.raises(ExportError, match="mtp_weights needs mtp=True"):
        export_model(None, tmp_path / "a", preset="tiny", mtp_weights={}, progress=False)
    with pytest.raises(ExportError, match="cannot be combined with stages"):
        export_model(None, tmp_path / "b", preset="tiny", mtp=True, stages=2, progress=False)
    with pytest.raises(ExportError, match="not a tensor of this model's MTP block"):
        export_model(None, tmp_path / "c", preset="tiny", mtp=True, mtp_weights={"layers.0.attn_sink": np.zeros(8)},
                     progress=False)
    with pytest.raises(ExportError, match="has shape"):
        export_model(None, tmp_path / "d", preset="tiny", mtp=True,
                     mtp_weights={"mtp.0.attn.attn_sink": np.zeros(3, np.float32)}, progress=False)
    with pytest.raises(ExportError, match="no MTP block"):
        _no_mtp_config_export(tmp_path / "e")


def _no_mtp_config_export(out):
    from dsv4_ort.export.exporter import export_model
    from dsv4_ort.models import write_random_checkpoint

    from model_fixtures import config

    ck = out.parent / "ck-no-mtp"
    cfg = config("tiny").replace(num_nextn_predict_layers=0, compress_ratios=[0, 4, 128, 4])
    write_random_checkpoint(ck, cfg)
    export_model(ck, out, mtp=True, progress=False)


def test_fitted_weights_replace_the_checkpoints(tmp_path):
    """mtp_weights: the export stores them in the release formats (the e_proj of the graph decodes to the FP8
    round trip of the given values; a norm weight to its bf16 rounding)."""
    from dsv4_ort.export import export_model
    from dsv4_ort.models import quant_np as QN

    rng = np.random.default_rng(0)
    w = {"mtp.0.e_proj.weight": rng.standard_normal((256, 256)).astype(np.float32) * 0.05,
         "mtp.0.enorm.weight": rng.standard_normal(256).astype(np.float32)}
    out = export_model(None, tmp_path / "fit", preset="tiny", mtp=True, mtp_weights=w, progress=False).parent
    meta = json.loads((out / "dsv4_ort.json").read_text())
    assert meta["mtp"]["fitted_weights"] is True
    m = onnx.load(str(out / "mtp.onnx"))
    init = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    codes, scale = init["mtp.0.e_proj.weight"], init["mtp.0.e_proj.scale"]
    q, s = QN.quant_fp8_block(w["mtp.0.e_proj.weight"])
    np.testing.assert_array_equal(codes.view(np.uint8), q)
    np.testing.assert_array_equal(scale, s)
    np.testing.assert_array_equal(init["mtp.0.enorm.weight"].astype(np.float32),
                                  QN.bf16_to_float(QN.float_to_bf16(w["mtp.0.enorm.weight"])))
