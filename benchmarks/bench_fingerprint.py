"""What the weight-hashing fingerprint costs at executor start: a folder of `--files` safetensors
shards totalling `--size-gib` GiB of random bytes, fingerprinted (1) with the files in the page
cache and no digest cache, (2) with the files evicted from the page cache (fsync + fadvise
DONTNEED: a first start after a copy or a reboot), (3) again with a warm digest cache (every later
start). Also sha256 vs blake2b on one core, in memory. Prints milliseconds and GB/s.

    python -m benchmarks.bench_fingerprint --size-gib 2 --files 4 [--dir /path/on/the/model/disk]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from executor_svc.fingerprint import source_identity  # noqa: E402

_BLOCK = 64 << 20  # written repeatedly with a counter, so no two blocks are equal


def write_shards(folder: Path, size: int, files: int) -> None:
    block = bytearray(os.urandom(_BLOCK))
    for i in range(files):
        with open(folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors", "wb") as f:
            written, n = 0, 0
            while written < size // files:
                block[:8] = n.to_bytes(8, "little")
                chunk = memoryview(block)[:min(_BLOCK, size // files - written)]
                f.write(chunk)
                written, n = written + len(chunk), n + 1
            f.flush()
            os.fsync(f.fileno())
    (folder / "config.json").write_text("{}")


def evict_from_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(label: str, size: int | None, fn) -> float:
    """Runs fn once; prints seconds and, for `size` bytes hashed, GB/s."""
    started = time.perf_counter()
    fn()
    seconds = time.perf_counter() - started
    rate = f"{size / seconds / 1e9:8.2f} GB/s" if size else ""
    print(f"{label:<46} {seconds * 1e3:9.1f} ms  {rate}")
    return seconds


def bench_algorithms() -> None:
    data = os.urandom(256 << 20)
    for name in ("sha256", "blake2b"):
        timed(f"{name}, one core, 256 MiB in memory", len(data),
              lambda: hashlib.new(name, data).hexdigest())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--files", type=int, default=1, help="shards (hashed in parallel threads)")
    p.add_argument("--dir", default=None, help="where to write them (default: the temp folder)")
    a = p.parse_args()
    size = int(a.size_gib * 2**30)
    print(f"{a.size_gib} GiB in {a.files} file(s), {os.cpu_count()} CPUs")
    bench_algorithms()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        folder, cache = Path(tmp) / "model", str(Path(tmp) / "cache")
        folder.mkdir()
        write_shards(folder, size, a.files)
        timed("fingerprint, files in page cache, no cache", size, lambda: source_identity(str(folder)))
        evict_from_page_cache(folder)
        timed("fingerprint, files evicted, cold digest cache", size,
              lambda: source_identity(str(folder), cache))
        timed("fingerprint, warm digest cache (a restart)", None,
              lambda: source_identity(str(folder), cache))


if __name__ == "__main__":
    main()
