"""Quantized checkpoints (awq, gptq, compressed-tensors, fp8): `config` reads a folder's
quantization_config, `linears` turns each quantized linear's tensors into an Int4Weight or an
Fp8Weight (`types`), which Backend.linear takes. Imports torch only.
"""
from executor_svc.quantization.config import SUPPORTED, QuantConfig, parse_quantization_config
from executor_svc.quantization.linears import check_linear, load_linear
from executor_svc.quantization.types import (Fp8Activation, Fp8Weight, Int4Weight,
                                             QuantizationError, fuse, takes_fp8_rows)

__all__ = ["SUPPORTED", "QuantConfig", "parse_quantization_config", "check_linear",
           "load_linear", "Fp8Activation", "Fp8Weight", "Int4Weight", "QuantizationError", "fuse",
           "takes_fp8_rows"]
