"""Text in and out: a tokenizer.json beside the model, the chat format, `dsv4-ort generate --prompt`."""

import os
import shutil
import subprocess
import sys

import pytest
from model_fixtures import require_library

from dsv4_ort.runtime import Session
from dsv4_ort.runtime.chat import ASSISTANT, BOS, EOS, USER, format_chat

SPECIALS = [BOS, EOS, USER, ASSISTANT, "<think>", "</think>"]


def make_tokenizer(path, vocab_size: int):
    """A small word-level tokenizer whose ids stay inside the tiny model's vocabulary; BOS = 0, EOS = 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["hello", "world", "the", "model", "runs", "on", "cpu", "a", "b", "c", "[UNK]"]
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    tok.save(str(path))


@pytest.fixture(scope="module")
def model_dir(cache, tmp_path_factory):
    require_library()
    src = cache.export(("tiny",), logits="last", max_seq_len=256).parent
    dst = tmp_path_factory.mktemp("text") / "m"
    shutil.copytree(src, dst)
    make_tokenizer(dst / "tokenizer.json", 512)
    return dst


def test_format_chat():
    text = format_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}])
    assert text == f"{BOS}be brief{USER}hi{ASSISTANT}</think>hello{EOS}{USER}more{ASSISTANT}</think>"
    assert format_chat([{"role": "user", "content": "x"}], thinking=True).endswith(f"{ASSISTANT}<think>")
    with pytest.raises(ValueError, match="end with a user"):
        format_chat([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="unknown role"):
        format_chat([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="must follow an assistant message with tool_calls"):
        format_chat([{"role": "tool", "content": "x"}])


def test_text_round_trip_and_chat(model_dir):
    sess = Session(model_dir, intra_op_threads=1)
    ids = sess.encode("hello world")
    assert ids[0] == 0 and sess.decode(ids[1:]) == "hello world"
    plain = sess.generate(ids, 8)
    assert sess.decode(plain) == sess.tokenizer.decode(plain)
    answer = sess.chat([{"role": "user", "content": "hello model"}], 8)
    assert isinstance(answer, str)
    prompt = sess.encode(format_chat([{"role": "user", "content": "hello model"}]), add_special_tokens=False)
    assert prompt.count(0) == 1  # one BOS, from the chat format


def test_generate_prompt_cli(model_dir):
    exe = os.path.join(os.path.dirname(sys.executable), "dsv4-ort")
    r = subprocess.run([exe, "generate", str(model_dir), "--prompt", "hello world", "--max-new-tokens", "5",
                        "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    sess = Session(model_dir, intra_op_threads=1)
    want = sess.tokenizer.decode(sess.generate(sess.encode("hello world"), 5))
    assert r.stdout.strip().replace(" ", "") == want.replace(" ", "")
