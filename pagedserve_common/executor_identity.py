"""What Describe says of an executor's model and KV cache: one record for both sides of the
wire (the executor's ExecutorInfo and the scheduler's ExecutorDescription extend it)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ExecutorIdentity:
    model_name: str
    fingerprint: str  # executors with the same fingerprint are interchangeable
    dtype: str
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    vocab_size: int
    tokenizer: str  # where the scheduler loads the tokenizer from (a folder or a GGUF file)
    backend: str  # "cpu" or "cuda"


def identity_fields(source: Any) -> dict[str, Any]:
    """ExecutorIdentity's fields read by name from `source` (a DescribeResponse or a record)."""
    return {f.name: getattr(source, f.name) for f in fields(ExecutorIdentity)}
