"""pagedserve kernels: CUDA sources compiled with cupy.RawModule, one launcher per family,
and torch reference twins with the same signatures (`kernels.reference`).

Nothing here imports cupy or touches a GPU at import time.
"""
