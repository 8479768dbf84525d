"""The model fingerprint: a hash of what decides the model's outputs (its config, the bytes of every
weight file, the tokenizer's files), so that the scheduler can refuse an executor serving other
weights. File digests are cached by (path, size, mtime, inode) in one small JSON file. No gRPC.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from executor_svc.cache_files import write_atomically
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import is_preset, tokenizer_source

log = logging.getLogger(__name__)

CACHE_FILE = "fingerprints.json"
# What PreTrainedTokenizerFast reads from a folder (the scheduler's tokenizer), when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
_MAX_HASH_THREADS = 8  # hashlib releases the GIL on large buffers: shards hash in parallel


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (hashlib reads it in 256 KiB chunks without the GIL)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class DigestCache:
    """{absolute path: (size, mtime_ns, inode, device) and sha256} in `directory`/fingerprints.json.
    A file whose stat changed is rehashed. Writes are atomic (temp file + os.replace); a corrupt
    or unwritable cache logs a warning and costs a rehash, never a failure."""

    def __init__(self, directory: str | None) -> None:
        self.path = Path(directory) / CACHE_FILE if directory else None
        self.entries = self._read(warn=True)
        self.updates: dict[str, dict] = {}

    def get(self, path: Path, st: os.stat_result) -> str | None:
        entry = self.entries.get(str(path))
        if entry is not None and entry.get("stat") == _stat_key(st):
            return entry.get("sha256")
        return None

    def put(self, path: Path, st: os.stat_result, digest: str) -> None:
        self.updates[str(path)] = {"stat": _stat_key(st), "sha256": digest}

    def save(self) -> None:
        """Merges our new digests into the file as it is now (another executor may have written
        it since we read it) and drops entries of files that no longer exist."""
        if self.path is None or not self.updates:
            return
        merged = {**self._read(warn=False), **self.updates}
        merged = {p: e for p, e in merged.items() if os.path.exists(p)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, json.dumps(merged, indent=1, sort_keys=True))
        except OSError as err:
            log.warning("fingerprint cache %s not written (%s): weights will be hashed again "
                        "at the next start", self.path, err)
            return
        self.entries, self.updates = merged, {}

    def _read(self, warn: bool) -> dict[str, dict]:
        if self.path is None:
            return {}
        try:
            entries = json.loads(self.path.read_text())
            if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
                raise ValueError("not a JSON object of entries")
            return entries
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            if warn:
                log.warning("fingerprint cache %s unreadable (%s): ignoring it", self.path, err)
            return {}


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


def digest_files(paths: list[Path], cache: DigestCache) -> dict[Path, str]:
    """{path: sha256} for absolute `paths`: from the cache where the stat still matches, else
    hashed (several files at once in threads), then cached."""
    started = time.perf_counter()
    stats = {p: p.stat() for p in paths}
    digests = {p: cache.get(p, stats[p]) for p in paths}
    misses = [p for p in paths if digests[p] is None]
    if misses:
        with ThreadPoolExecutor(min(len(misses), _MAX_HASH_THREADS)) as pool:
            for path, digest in zip(misses, pool.map(file_sha256, misses)):
                digests[path] = digest
                cache.put(path, stats[path], digest)
        cache.save()
    hashed = sum(stats[p].st_size for p in misses)
    log.info("fingerprint: %d files, %.2f GB hashed, %d from cache, in %.2f s", len(paths),
             hashed / 1e9, len(paths) - len(misses), time.perf_counter() - started)
    return digests


def source_identity(source: str, cache_dir: str | None = None) -> dict[str, Any]:
    """What `source` serves, by content and without absolute paths (identical copies anywhere
    match): a folder's weight and tokenizer files by name and digest; a .gguf file (which holds
    its tokenizer too) by digest alone; a preset by name (its weights are drawn, not read)."""
    tokenizer = tokenizer_source(source)
    if is_preset(source):  # no files to hash: the name (and the seed, in fingerprint) identify it
        return {"source": source, "tokenizer": _name_and_size(tokenizer) if tokenizer else ""}
    path = Path(source).resolve()
    cache = DigestCache(cache_dir)
    if not path.is_dir():
        return {"weights": digest_files([path], cache)[path], "tokenizer": "weights"}
    weights = weight_files(path)
    tokenizer_files = [path / n for n in TOKENIZER_FILES if (path / n).is_file()] if tokenizer else []
    digests = digest_files(weights + tokenizer_files, cache)
    return {"weights": {p.name: digests[p] for p in weights},
            "tokenizer": {p.name: digests[p] for p in tokenizer_files}}


def weight_files(folder: Path) -> list[Path]:
    """The files transformers loads weights from: *.safetensors, else pytorch_model*.bin."""
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))


def start_source_identity(source: str, cache_dir: str | None) -> Future:
    """source_identity in a background thread, so that hashing overlaps weight loading."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="fingerprint")
    future = pool.submit(source_identity, source, cache_dir)
    pool.shutdown(wait=False)
    return future


def model_fingerprint(config: ModelConfig, identity: dict[str, Any], seed: int = 0,
                      init_device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32,
                      kv_cache_dtype: str | None = None) -> str:
    """sha256 of the model config (its quantization included) and `identity` (from
    source_identity). Random preset weights also depend on the seed and on the device type and
    dtype they are drawn on. A quantized KV cache (kv_cache_dtype "fp8_e4m3"; None: the model's
    dtype, which adds nothing) holds other values than the model computes, so it is hashed too:
    the scheduler's prefix cache, salted with the fingerprint, never takes pages of one KV dtype
    for another's, nor does a failover or switch move seqs between them."""
    fields = {"config": asdict(config), **identity}
    if kv_cache_dtype is not None:
        fields["kv_cache_dtype"] = kv_cache_dtype
    if "weights" not in identity:
        fields["seed"] = seed
        fields["drawn_on"] = [torch.device(init_device).type, str(dtype)]
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def tokenizer_identity(source: str) -> list[Any]:
    """A tokenizer served instead of the model's (--tokenizer), as a preset's is named: its
    file's name and size (tokenizer.json in a folder)."""
    path = Path(source)
    return _name_and_size(str(path / "tokenizer.json" if path.is_dir() else path))


def _name_and_size(path: str) -> list[Any]:
    return [Path(path).name, os.path.getsize(path)]
