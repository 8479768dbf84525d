"""Whether the GPU tests can run here: CuPy imports and sees a device, and torch sees CUDA."""
from __future__ import annotations

OUTER_VECTOR_CUBLASLT = 120900  # cuBLASLt's version from which it has outer-vector FP8 scales


def gpu_ready() -> bool:
    try:
        import cupy
        import torch

        return torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
