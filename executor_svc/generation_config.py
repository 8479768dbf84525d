"""A model folder's generation config as serving reads it (as vLLM does): generation_config.json,
else config.json's EOS ids; none for a GGUF file or a preset. Plain JSON: no torch, no transformers.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from executor_svc.step import ModelGenerationConfig

GENERATION_CONFIG_FILE = "generation_config.json"
# The wire's carriers: EOS ids are uint32, top_k int64, max_new_tokens uint64.
_MAX_TOKEN_ID = 2**32 - 1
_MAX_INT64 = 2**63 - 1
_SHOWN_CHARS = 64


def read_generation_config(source: str, model_eos_token_ids: tuple[int, ...]
                           ) -> ModelGenerationConfig:
    """What serving takes from `source`'s generation config. Without generation_config.json, the
    EOS ids of config.json (`model_eos_token_ids`), as transformers' GenerationConfig
    .from_model_config gives vLLM. Raises ValueError naming the file and the key of a value
    out of range or of the wrong type: every request would otherwise inherit it."""
    path = Path(source)
    if not path.is_dir():  # a .gguf file or a preset: vLLM reads no generation config for either
        return ModelGenerationConfig()
    file = path / GENERATION_CONFIG_FILE
    if not file.is_file():
        return ModelGenerationConfig(eos_token_ids=model_eos_token_ids)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {type(data).__name__}")
    check = _Checker(file, data)
    return ModelGenerationConfig(
        eos_token_ids=check.eos_token_ids(),
        temperature=check.number("temperature", "must be >= 0", lambda v: v >= 0),
        top_p=check.number("top_p", "must be in (0, 1]", lambda v: 0 < v <= 1),
        top_k=check.integer("top_k", "must be -1, 0 (off) or more", lambda v: v >= -1),
        min_p=check.number("min_p", "must be in [0, 1]", lambda v: 0 <= v <= 1),
        repetition_penalty=check.number("repetition_penalty", "must be > 0", lambda v: v > 0),
        max_new_tokens=check.integer("max_new_tokens", "must be >= 1", lambda v: v >= 1),
    )


class _Checker:
    """Reads one key of the file at a time; a key absent or null is unset (vLLM takes only the
    values a file sets)."""

    def __init__(self, file: Path, data: dict[str, Any]) -> None:
        self.file, self.data = file, data

    def _fail(self, key: str, rule: str, value: Any) -> ValueError:
        return ValueError(f"{self.file}: {key} {rule}, got {json.dumps(value)[:_SHOWN_CHARS]}")

    def number(self, key: str, rule: str, ok) -> float | None:
        value = self.data.get(key)
        if value is None:
            return None
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or not ok(value)):
            raise self._fail(key, f"{rule} (a finite number)", value)
        return float(value)

    def integer(self, key: str, rule: str, ok) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        if (isinstance(value, bool) or not isinstance(value, int) or not ok(value)
                or value > _MAX_INT64):
            raise self._fail(key, f"{rule} (an integer)", value)
        return value

    def eos_token_ids(self) -> tuple[int, ...]:
        value = self.data.get("eos_token_id")
        if value is None:
            return ()
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _MAX_TOKEN_ID
                   for i in ids):
            raise self._fail("eos_token_id", "must be a token id or a list of them", value)
        return tuple(dict.fromkeys(ids))
