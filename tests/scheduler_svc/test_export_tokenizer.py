"""`pagedserve-export-tokenizer`, run as a user runs it: the folder it writes loads with
`AutoTokenizer.from_pretrained` and tokenizes and renders chats as the GGUF's own tokenizer does."""

import json
import os
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sched_factories import smollm2_gguf_path
from scheduler_svc.export_tokenizer import default_model_source
from scheduler_svc.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Hello, world!", "  spaces\tand\nnewlines\n\n", "café 日本語 😀👍🏽 🇫🇷",
         "<|im_start|>user\nhi<|im_end|>", ""]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "A joke?"}],
]


def export(*args: str) -> subprocess.CompletedProcess:
    """The command as installed: pyproject's entry point, run from the source tree."""
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["pagedserve-export-tokenizer"].split(":")
    assert func == "main"
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def render(code: str) -> dict:
    """`code` sets `tok`; returns its ids for TEXTS, its chat renderings and its specials, from a
    fresh interpreter (AutoTokenizer imports torch)."""
    out = subprocess.run(
        [sys.executable, "-c", "import json\nfrom transformers import AutoTokenizer\n" + code + "\n"
         f"chats = {CHATS!r}\n"
         "print(json.dumps({'ids': [tok(t).input_ids for t in " + repr(TEXTS) + "],\n"
         "  'chat_text': [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)"
         " for c in chats],\n"
         "  'chat_ids': [list(tok.apply_chat_template(c, add_generation_prompt=True,"
         " tokenize=True)['input_ids']) for c in chats],\n"
         "  'specials': [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id],\n"
         "  'special_ids': sorted(tok.all_special_ids), 'len': len(tok),\n"
         "  'template': tok.chat_template, 'max_len': tok.model_max_length}))"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    gguf = smollm2_gguf_path()
    out = tmp_path_factory.mktemp("export") / "SmolLM2-135M-Instruct-tokenizer"
    done = export(str(out))  # no --model: the default model's
    assert done.returncode == 0, done.stderr
    assert str(out) in done.stdout and gguf in done.stdout
    return out


def test_the_default_model_is_the_executors():
    from executor_svc.model_loader import smollm2_gguf_path as executor_default

    assert default_model_source() == executor_default()


def test_folder_holds_what_tools_read(exported):
    assert sorted(p.name for p in exported.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == load_tokenizer(smollm2_gguf_path()).hf_tokenizer.chat_template
    specials = json.loads((exported / "special_tokens_map.json").read_text())
    assert specials == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}


def test_auto_tokenizer_matches_the_gguf(exported):
    """The folder, through AutoTokenizer, against transformers' own GGUF loader and the tokenizer
    the scheduler serves with."""
    gguf = Path(smollm2_gguf_path())
    with ThreadPoolExecutor(2) as pool:  # two interpreters side by side
        folder, theirs = pool.map(render, [
            f"tok = AutoTokenizer.from_pretrained({str(exported)!r})",
            f"tok = AutoTokenizer.from_pretrained({str(gguf.parent)!r}, gguf_file={gguf.name!r})"])
    assert folder["max_len"] == 8192  # the GGUF's llama.context_length
    folder.pop("max_len"), theirs.pop("max_len")
    assert folder == theirs
    served = load_tokenizer(str(gguf))
    assert folder["ids"] == [served.encode(t) for t in TEXTS]
    assert folder["chat_ids"] == [served.apply_chat_template(c) for c in CHATS]
    assert folder["chat_text"][0].endswith("<|im_start|>assistant\n")


def test_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    refused = export(str(tmp_path))
    assert refused.returncode == 2 and "not an empty folder" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("content", [b"", b"GGUF\x03\x00\x00\x00" + b"\xff" * 16, b"not gguf"],
                         ids=["empty", "truncated", "no-magic"])
def test_a_file_that_is_no_tokenizer_is_one_line(tmp_path, content):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    failed = export("--model", str(bad), str(tmp_path / "out"))
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert f"--model {bad}" in failed.stderr and len(failed.stderr.strip().splitlines()) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # nothing half-written


def test_a_missing_model_is_one_line(tmp_path):
    failed = export("--model", str(tmp_path / "nope.gguf"), str(tmp_path / "out"))
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert "nope.gguf" in failed.stderr and not (tmp_path / "out").exists()
