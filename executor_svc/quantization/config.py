"""A folder's `quantization_config` (awq, gptq, compressed-tensors, fp8) read with vLLM's
acceptance rules: which modules are quantized, and how. Plain Python; no tensors.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from executor_svc.quantization.types import QuantizationError

SUPPORTED = ("awq (4-bit, GEMM layout), gptq (4-bit), compressed-tensors (W4A16 pack-quantized, "
             "FP8 W8A8 float-quantized) and fp8 (per-tensor or per-channel weight scales)")
GROUP_SIZES = (32, 64, 128, -1)  # -1: one group per output channel (vLLM's Marlin set)


@dataclass(frozen=True)
class Int4Scheme:
    method: str  # "awq" | "gptq" | "compressed-tensors"
    group_size: int  # -1: per channel
    sym: bool
    gptq_v1: bool = False  # zero points stored minus one (AutoGPTQ's and GPTQModel's default)
    g_idx: bool = False  # the checkpoint must carry g_idx (act-order)


@dataclass(frozen=True)
class Fp8Scheme:
    method: str  # "fp8" | "compressed-tensors"
    per_channel: bool
    static: bool
    per_token: bool
    block_size: tuple[int, int] | None = None  # (bn, bk): block-wise weight scales


@dataclass(frozen=True)
class QuantConfig:
    """What a folder's quantization_config says, and which modules it quantizes how."""

    name: str  # for ModelInfo and the fingerprint, e.g. "gptq int4 g128 act-order"
    scheme_for: Callable[[str], Int4Scheme | Fp8Scheme | None]  # module name -> its scheme
    # The checkpoint's k_scale / v_scale serve an FP8 KV cache (vLLM's fp8 and compressed-tensors
    # attach a KV cache method to attention; awq and gptq do not)
    kv_cache_scales: bool = False


def parse_quantization_config(qc: Any) -> QuantConfig:
    """Raises QuantizationError (one line naming the method or option) for what we cannot serve."""
    if not isinstance(qc, dict):
        raise QuantizationError(f"quantization_config is not a JSON object; supported: {SUPPORTED}")
    method = str(qc.get("quant_method", "")).lower()
    parse = _PARSERS.get(method)
    if parse is None:
        raise QuantizationError(f"quantization method {method or 'none'!r} is not supported; "
                                f"supported: {SUPPORTED}")
    return parse(qc)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise QuantizationError(message)


def _group_size(method: str, value: Any) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool) and value in GROUP_SIZES,
             f"{method} group_size {value!r} is not supported; supported: 32, 64, 128 or -1 "
             "(per channel)")
    return value


def _bits(method: str, value: Any) -> None:
    _require(value == 4 and not isinstance(value, bool),
             f"{method} with {value!r}-bit weights is not supported; supported: 4-bit")


def _parse_awq(qc: dict) -> QuantConfig:
    _bits("awq", qc.get("bits", qc.get("w_bit")))
    group = _group_size("awq", qc.get("group_size", qc.get("q_group_size")))
    version = str(qc.get("version", "gemm")).lower()
    _require(version == "gemm", f"awq version {version!r} is not supported; supported: 'gemm' "
                                "(AutoAWQ's GEMM layout)")
    _require(qc.get("zero_point", True) is True, "awq without zero points (zero_point: false) is "
                                                 "not supported; supported: zero_point true")
    skip = list(qc.get("modules_to_not_convert") or [])
    scheme = Int4Scheme("awq", group, sym=False)
    return QuantConfig(f"awq int4 g{group}",
                       lambda name: None if any(s in name for s in skip) else scheme)


def _parse_gptq(qc: dict) -> QuantConfig:
    _bits("gptq", qc.get("bits"))
    group = _group_size("gptq", qc.get("group_size"))
    _require(not qc.get("lm_head", False), "gptq with a quantized lm_head (lm_head: true) is not "
                                           "supported; supported: lm_head false")
    _require(not qc.get("dynamic"), "gptq 'dynamic' per-module overrides are not supported; "
                                    "supported: one scheme for every layer")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq")) or "gptq").lower()
    _require(fmt in ("gptq", "gptq_v2"), f"gptq checkpoint_format {fmt!r} is not supported; "
                                         "supported: 'gptq', 'gptq_v2'")
    sym, desc_act = bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
    only = [m for ms in qc.get("modules_in_block_to_quantize") or [] for m in
            (ms if isinstance(ms, list) else [ms])]
    scheme = Int4Scheme("gptq", group, sym, gptq_v1=fmt == "gptq", g_idx=desc_act)

    def scheme_for(name: str):
        return scheme if not only or any(name.endswith("." + m) for m in only) else None
    act = " act-order" if desc_act and group != -1 else ""
    return QuantConfig(f"gptq int4 g{group}{'' if sym else ' asym'}{act}", scheme_for)


def _parse_fp8(qc: dict) -> QuantConfig:
    act = qc.get("activation_scheme", "dynamic")
    _require(act in ("dynamic", "static"), f"fp8 activation_scheme {act!r} is not supported; "
                                           "supported: 'dynamic', 'static'")
    block = _block("fp8 weight_block_size", qc.get("weight_block_size"))
    _require(block is None or act == "dynamic", "fp8 with weight_block_size and "
                                                "activation_scheme 'static' is not supported; "
                                                "supported: 'dynamic' with block-wise scales")
    skip = set(qc.get("ignored_layers") or []) | set(qc.get("modules_to_not_convert") or [])
    scheme = Fp8Scheme("fp8", per_channel=False, static=act == "static", per_token=False,
                       block_size=block)
    name = f"fp8 w8a8 {act}" + (f" block {block[0]}x{block[1]}" if block else "")
    return QuantConfig(name, lambda module: None if _skipped(module, skip) else scheme,
                       kv_cache_scales=True)


def _block(what: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    ok = (isinstance(value, list) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value))
    _require(ok, f"{what} {value!r} is not supported; supported: two positive integers")
    return value[0], value[1]


def _skipped(name: str, skip: set[str]) -> bool:
    return name in skip or any(name.endswith("." + s) for s in skip)


def _parse_compressed_tensors(qc: dict) -> QuantConfig:
    status = qc.get("quantization_status", "compressed")
    _require(status == "compressed", f"compressed-tensors quantization_status {status!r} is not "
                                     "supported; supported: 'compressed'")
    for key in ("sparsity_config", "transform_config"):
        _require(not qc.get(key), f"compressed-tensors {key} is not supported; supported: "
                                  "W4A16 pack-quantized and FP8 W8A8 float-quantized")
    _ct_kv_cache_scheme(qc.get("kv_cache_scheme"))
    groups = qc.get("config_groups") or {}
    _require(isinstance(groups, dict) and groups, "compressed-tensors without config_groups")
    default_format = qc.get("format")
    schemes = [(g.get("targets") or [], _ct_scheme(n, g, default_format))
               for n, g in groups.items()]
    ignore = list(qc.get("ignore") or [])
    names = sorted({_ct_name(s) for _, s in schemes})

    def scheme_for(name: str):
        if any(_ct_matches(name, pattern) for pattern in ignore):
            return None
        for targets, scheme in schemes:
            if any(t == "Linear" or _ct_matches(name, t) for t in targets):
                return scheme
        return None
    return QuantConfig("compressed-tensors " + ", ".join(names), scheme_for,
                       kv_cache_scales=True)


def _ct_kv_cache_scheme(scheme: Any) -> None:
    """vLLM's check of a kv_cache_scheme (its scales serve --kv-cache-dtype fp8): 8-bit float,
    one symmetric scale per layer."""
    if not scheme:
        return
    _require(isinstance(scheme, dict) and scheme.get("type") == "float"
             and scheme.get("num_bits") == 8,
             f"compressed-tensors kv_cache_scheme {scheme!r} is not supported; supported: "
             "num_bits 8, type float")
    _require(scheme.get("strategy") == "tensor" and scheme.get("symmetric") is True,
             f"compressed-tensors kv_cache_scheme strategy {scheme.get('strategy')!r} "
             f"(symmetric {scheme.get('symmetric')!r}) is not supported; supported: one "
             "symmetric scale per layer (strategy tensor)")


def _ct_matches(name: str, pattern: str) -> bool:
    """compressed-tensors' target rule: "re:<regex>" matched from the start, else the name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _ct_name(s: Int4Scheme | Fp8Scheme) -> str:
    if isinstance(s, Int4Scheme):
        return f"w4a16 g{s.group_size}{'' if s.sym else ' asym'}{' act-order' if s.g_idx else ''}"
    if s.block_size is not None:
        return f"fp8 w8a8 dynamic block {s.block_size[0]}x{s.block_size[1]}"
    return f"fp8 w8a8 {'static' if s.static else 'dynamic per-token'}"


def _ct_scheme(name: str, group: dict, default_format: str | None) -> Int4Scheme | Fp8Scheme:
    where = f"compressed-tensors config_groups.{name}"
    fmt = group.get("format") or default_format
    w, a = group.get("weights") or {}, group.get("input_activations")
    _require(group.get("output_activations") is None, f"{where}: output_activations are not "
                                                      "supported")
    if fmt == "pack-quantized":
        _require(w.get("type") == "int", f"{where}: pack-quantized {w.get('type')!r} weights are "
                                         "not supported; supported: int")
        _bits(f"{where}: pack-quantized", w.get("num_bits"))
        _require(a is None, f"{where}: W4 with activation quantization is not supported; "
                            "supported: W4A16")
        strategy = w.get("strategy")
        _require(strategy in ("group", "channel"), f"{where}: weight strategy {strategy!r} is not "
                                                   "supported; supported: group, channel")
        group_size = -1 if strategy == "channel" else _group_size(where, w.get("group_size"))
        actorder = w.get("actorder")
        _require(actorder in (None, "weight", "group"), f"{where}: actorder {actorder!r} is not "
                                                        "supported; supported: group, weight")
        return Int4Scheme("compressed-tensors", group_size, bool(w.get("symmetric", True)),
                          g_idx=actorder == "group")
    if fmt == "float-quantized":
        return _ct_fp8_scheme(where, w, a)
    raise QuantizationError(f"{where}: format {fmt!r} is not supported; supported: "
                            "pack-quantized (W4A16), float-quantized (FP8 W8A8)")


def _ct_fp8_scheme(where: str, w: dict, a: dict | None) -> Fp8Scheme:
    _require(w.get("type") == "float" and w.get("num_bits") == 8,
             f"{where}: float-quantized weights of {w.get('num_bits')!r} bits, type "
             f"{w.get('type')!r} are not supported; supported: 8-bit float (e4m3)")
    strategy = w.get("strategy")
    _require(strategy in ("channel", "tensor", "block"), f"{where}: FP8 weight strategy "
             f"{strategy!r} is not supported; supported: channel, tensor, block")
    _require(w.get("symmetric", True) and not w.get("dynamic", False),
             f"{where}: asymmetric or dynamic FP8 weights are not supported")
    _require(a is not None and a.get("type") == "float" and a.get("num_bits") == 8,
             f"{where}: FP8 weights without FP8 activations (W8A16) are not supported; "
             "supported: W8A8")
    dynamic, act_strategy = bool(a.get("dynamic")), a.get("strategy")
    block = _block(f"{where}: block_structure", w.get("block_structure")) if (
        strategy == "block") else None
    ok = ((dynamic and act_strategy in ("token", "tensor") and block is None)
          or (not dynamic and act_strategy == "tensor" and block is None)
          or (dynamic and act_strategy == "group" and block is not None
              and a.get("group_size") == block[1]))
    _require(ok, f"{where}: input_activations strategy {act_strategy!r} "
                 f"({'dynamic' if dynamic else 'static'}) with {strategy} weights is not "
                 "supported; supported: dynamic per-token or per-tensor, static per-tensor, "
                 "and with block weights dynamic groups of the block's input size")
    return Fp8Scheme("compressed-tensors", per_channel=strategy == "channel", static=not dynamic,
                     per_token=dynamic and act_strategy == "token", block_size=block)


_PARSERS = {"awq": _parse_awq, "gptq": _parse_gptq, "fp8": _parse_fp8,
            "compressed-tensors": _parse_compressed_tensors}
