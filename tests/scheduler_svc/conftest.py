"""Makes sched_factories importable whatever pytest's import mode is; the SmolLM2 tokenizer fixture."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402

from sched_factories import smollm2_gguf_path  # noqa: E402
from scheduler_svc.tokenizer import Tokenizer, load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(smollm2_gguf_path())
