"""What this CPU and this torch build can do for the CPU GEMM, read once: oneDNN's presence, its own answer on
bfloat16, and whether the CPU has bf16 instructions (oneDNN otherwise emulates bf16, slower than float32).

oneDNN may be capped below the CPU (ONEDNN_MAX_CPU_ISA, as the suite does to test the AVX2 path on any machine):
its own answer follows the cap, and so does `native_bf16` here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from surge import envs

# oneDNN's ISA names (its ONEDNN_MAX_CPU_ISA values) that leave out every bf16 instruction: a cap at one of these
# turns native bf16 off whatever the CPU has. AVX2_VNNI_2 brings AVX-NE-CONVERT, AVX512_CORE_BF16 AVX512-BF16.
_ISA_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"})
# CPU feature flags (Linux /proc/cpuinfo names) of instructions that compute on bf16: x86's AVX512-BF16, AMX-BF16
# and AVX-NE-CONVERT; aarch64's BF16 extension.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16"})


@dataclass(frozen=True)
class CpuCaps:
    onednn: bool  # torch has oneDNN with the linear ops the GEMM uses
    onednn_bf16: bool  # oneDNN takes bf16 weights here (natively or emulated); its own answer, then a probe
    native_bf16: bool  # the CPU has bf16 instructions oneDNN may use (not capped away)
    aten: str  # torch's vector dispatch level: AVX2, AVX512, DEFAULT ... (ATEN_CPU_CAPABILITY caps it)

    def describe(self) -> str:
        return (f"torch dispatch {self.aten}, oneDNN {'yes' if self.onednn else 'no'}, oneDNN bf16 "
                f"{'yes' if self.onednn_bf16 else 'no'}, bf16 instructions {'yes' if self.native_bf16 else 'no'}")


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, aarch64 `Features`); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _onednn_linear_ops() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _onednn_takes_bf16() -> bool:
    """oneDNN's answer, then one tiny packing and GEMM: a refusal here costs nothing, at a model's first step it
    was a crash."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        w = torch.ones(16, 32, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 32, dtype=torch.bfloat16), packed, None, "none", [],
                                                 "")
        return bool((out == 32).all())
    except (AttributeError, RuntimeError):
        return False


def native_bf16(flags: frozenset[str], onednn_isa_cap: str | None) -> bool:
    """Whether oneDNN may compute bf16 with the CPU's own instructions: a flag of one, and no cap below it."""
    return bool(flags & _BF16_FLAGS) and (onednn_isa_cap or "").upper() not in _ISA_WITHOUT_BF16


@functools.cache
def cpu_caps() -> CpuCaps:
    onednn = _onednn_linear_ops()
    return CpuCaps(onednn=onednn, onednn_bf16=onednn and _onednn_takes_bf16(),
                   native_bf16=native_bf16(_cpu_flags(), envs.ONEDNN_MAX_CPU_ISA),
                   aten=torch.backends.cpu.get_cpu_capability())
