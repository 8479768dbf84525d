"""The header of a GGUF file: its key-value metadata and where each tensor lies, read without the
gguf package (whose reader parses every array element apart, seconds for a vocabulary) and
without the tensors' data. Standard library only.
"""

import mmap
import struct
from dataclasses import dataclass
from typing import Any

# GGUF metadata value types: the fixed-size ones, then string (8) and array (9)
_GGUF_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GgufTensorInfo:
    """One tensor of the file: `dims` in llama.cpp's order (the row length first), its ggml type
    number, and where its data starts, counted from the file's start."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


def read_gguf_metadata(path: str, prefixes: tuple[str, ...] = ("",)) -> dict[str, Any]:
    """The key-value metadata of a GGUF (v2/v3) file whose keys start with one of `prefixes`.

    Reads only the header, never the tensors; values of other keys are parsed and dropped.
    """
    return read_gguf_header(path, prefixes)[0]


def read_gguf_header(path: str, prefixes: tuple[str, ...] = ("",)
                     ) -> tuple[dict[str, Any], list[GgufTensorInfo]]:
    """(the metadata whose keys start with one of `prefixes`, every tensor's place): the header
    only. ValueError (or struct.error past its end) for a file that is not GGUF v2/v3."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        reader = _GgufMetadataReader(buf)
        magic, version, num_tensors, num_kv = reader.unpack("<4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        metadata, alignment = {}, _DEFAULT_ALIGNMENT
        for _ in range(num_kv):
            key = reader.string()
            value = reader.value(reader.unpack("<I")[0])
            if key == "general.alignment":
                alignment = value
            if key.startswith(prefixes):
                metadata[key] = value
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        places = []
        for _ in range(num_tensors):
            name = reader.string()
            (num_dims,) = reader.unpack("<I")
            dims = reader.unpack(f"<{num_dims}Q")
            ggml_type, offset = reader.unpack("<IQ")
            places.append((name, dims, ggml_type, offset))
        data_start = -(-reader.pos // alignment) * alignment
        return metadata, [GgufTensorInfo(name, tuple(dims), ggml_type, data_start + offset)
                          for name, dims, ggml_type, offset in places]


class _GgufMetadataReader:
    """A cursor over the header of a GGUF file (little-endian)."""

    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _GGUF_STRING:
            return self.string()
        if value_type == _GGUF_ARRAY:
            item_type, count = self.unpack("<IQ")
            if item_type in _GGUF_SCALAR_FORMATS:  # one unpack for the whole array
                return list(self.unpack(f"<{count}{_GGUF_SCALAR_FORMATS[item_type][1]}"))
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _GGUF_SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        return self.unpack(_GGUF_SCALAR_FORMATS[value_type])[0]
