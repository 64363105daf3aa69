"""Whether this CPU multiplies bf16 natively, or emulates it in software (several times slower than fp32).

torch's bf16 matmuls on a CPU run in oneDNN. With AVX512_BF16 or AMX (x86) or the BF16 extension (Arm)
they run at about twice the fp32 rate; without, oneDNN converts to fp32 around each product and a bf16
block runs 2-4x slower than the same block in fp32 (notes/quick-profile.md measures both). oneDNN's
ISA cap (ONEDNN_MAX_CPU_ISA, formerly DNNL_MAX_CPU_ISA) disables the bf16 instructions of a CPU that
has them, so it is read too: a cap below AVX512_CORE_BF16 is emulation as well.
"""
from __future__ import annotations

import os
import platform

# oneDNN's ISA names that include bf16 dot products (x86): a cap at any other disables them
BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
             "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL")
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_BF16_FLAGS = ("bf16",)  # /proc/cpuinfo "Features" on aarch64 (FEAT_BF16)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags ("flags" on x86, "Features" on Arm) from the first processor in
    /proc/cpuinfo; None where there is no such file (macOS, Windows)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        return None
    return set()


def isa_cap(env=None) -> str | None:
    """oneDNN's ISA cap as set in the environment (upper case), or None."""
    env = os.environ if env is None else env
    cap = env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA")
    return cap.strip().upper() if cap else None


def bf16_emulated(flags: set[str] | None = None, env=None, machine: str | None = None) -> str | None:
    """Why bf16 is emulated on this CPU (one phrase), or None where it is native or cannot be told
    (no /proc/cpuinfo: Apple silicon has bf16 and is not second-guessed).

    Args:
        flags: the CPU's flags (default: cpu_flags()).
        env: the environment (default: os.environ), for ONEDNN_MAX_CPU_ISA.
        machine: platform.machine() by default ("x86_64", "aarch64", ...).
    """
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return None
    machine = (machine or platform.machine()).lower()
    if machine in ("aarch64", "arm64"):
        return None if flags & set(ARM_BF16_FLAGS) else "this CPU has no bf16 instructions (Arm FEAT_BF16)"
    if not flags & set(X86_BF16_FLAGS):
        return "this CPU has no avx512_bf16 or amx_bf16"
    cap = isa_cap(env)
    if cap is not None and cap not in BF16_ISAS:
        return f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN from this CPU's bf16 instructions"
    return None
