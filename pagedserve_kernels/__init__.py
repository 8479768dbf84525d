"""pagedserve kernels: CUDA sources compiled with cupy.RawModule, one launcher per family,
and torch reference twins with the same signatures (`pagedserve_kernels.reference`).

Nothing here imports cupy or touches a GPU at import time. What the executor may use beyond the
launchers: `warmup` (compile every kernel now; seconds per module) and `arch_used` (the -arch
option a device's kernels were compiled with; None before they are).
"""
from pagedserve_kernels._compile import arch_used, warmup

__all__ = ["arch_used", "warmup"]
