"""The random weights of a small preset, kept in the cache folder once drawn: a draw needs
transformers' model classes, whose import takes seconds at every start; reading the weights back
takes none. An entry is keyed by all that makes the draw (the preset, seed, dtype and device type,
the torch and transformers versions, and our presets' and loader's source), so a changed one is
drawn again; it is written atomically, and one that cannot be read is drawn again.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
from pathlib import Path

import torch

from executor_svc.cache_files import write_atomically
from executor_svc.model_config import ModelConfig

log = logging.getLogger(__name__)

MAX_BYTES = 64 << 20  # the test-sized presets; a large preset's draw is not worth its disk
_FOLDER = "presets"
# what defines a preset's config and its draw
_SOURCES = ("model_config.py", "model_loader.py")


def _draw(preset: str, seed: int, dtype: torch.dtype, device) -> str:
    """What is drawn, in a file name: an entry of it made by other code replaces the last."""
    return f"{preset}-seed{seed}-{str(dtype).removeprefix('torch.')}-{torch.device(device).type}"


def _path(cache_dir: str, preset: str, seed: int, dtype: torch.dtype, device) -> Path:
    draw = _draw(preset, seed, dtype, device)
    digest = hashlib.sha256("\0".join(
        (draw, torch.__version__, importlib.metadata.version("transformers"))).encode())
    for name in _SOURCES:
        digest.update((Path(__file__).parent / name).read_bytes())
    return Path(cache_dir) / _FOLDER / f"{draw}-{digest.hexdigest()[:24]}.safetensors"


def load(cache_dir: str | None, preset: str, seed: int, dtype: torch.dtype, device
         ) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    """(config, weights by transformers' names on `device`) as drawn before, or None."""
    if not cache_dir:
        return None
    path = _path(cache_dir, preset, seed, dtype, device)
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device=str(torch.device(device))) as f:
            config = ModelConfig.from_json(f.metadata()["config"])
            return config, {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # noqa: BLE001 - any unreadable entry: drawn again, and rewritten
        log.warning("preset cache %s not read (%s): drawing the weights again", path, err)
        return None


def store(cache_dir: str | None, preset: str, seed: int, dtype: torch.dtype, device,
          config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Keeps a draw of at most MAX_BYTES (a tensor tied to another once), replacing the same
    draw's entry by other code or versions; an unwritable folder costs a draw at the next start,
    no failure."""
    if not cache_dir:
        return
    unique, seen = {}, set()
    for name, tensor in weights.items():
        if tensor.data_ptr() not in seen:  # tied (lm_head = embed_tokens): the model reties it
            seen.add(tensor.data_ptr())
            unique[name] = tensor
    if sum(t.numel() * t.element_size() for t in unique.values()) > MAX_BYTES:
        return
    from safetensors.torch import save

    data = save({name: t.detach().contiguous().cpu() for name, t in unique.items()},
                metadata={"config": config.to_json()})
    path = _path(cache_dir, preset, seed, dtype, device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, data)
        for old in path.parent.glob(f"{_draw(preset, seed, dtype, device)}-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError as err:
        log.warning("preset cache %s not written (%s): the weights will be drawn again at the "
                    "next start", path, err)
