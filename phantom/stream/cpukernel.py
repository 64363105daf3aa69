"""The 8-bit AdamW update on a CPU as one C loop: each block of 256 read once (weight, gradient, codes),
its moments kept in registers and a stack buffer, the weight and the new codes written once. Compiled
on first use with the system's C compiler (-O3 for this CPU, no contraction into fused multiply-adds,
so it rounds as torch does op by op) into the cache, under a lock so that processes starting together
compile it once; called through ctypes, which releases the GIL, from one thread per core over
contiguous ranges of blocks.

Why C: the update is memory-bound (16 bytes a parameter), and torch, eager or compiled, gathers
through int64 indices and makes the codes' round trip in several passes (10-20x the fused fp32
AdamW's time per parameter on a 2-core EPYC). Where no compiler is found, `load` says so once and
phantom.stream.adam8bit runs its torch form of the same update.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from phantom.base import fileio

log = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline uint32_t nearest(float x, const int32_t* table, const float* above) {
    uint32_t bits; memcpy(&bits, &x, 4);
    int32_t below = table[(bits >> 14) & 0x3FFFF];
    return (uint32_t)below + (x >= above[below]);
}

static inline uint8_t lookup(float x, const int32_t* lut) {  /* bitsandbytes' CPU rounding */
    x = x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x);
    return (uint8_t)lut[(uint16_t)((x + 1.0f) * 0.5f * 65535.0f + 0.5f)];
}

typedef struct { float decay, step, c2, eps, b1, a1, b2, a2, coef; } hyper_t;

/* elements [s, e) of one block: the update of p, the new moments into m, v; returns their maxima */
static void moments(float* p, const float* g, const uint8_t* mq, const uint8_t* vq, float msc, float vsc,
                    int64_t s, int64_t e, const hyper_t* k, const float* mcode, const float* vcode,
                    float* m, float* v, float* mmax_, float* vmax_) {
    float mmax = 0.0f, vmax = 0.0f;
    int64_t i = s;
#ifdef __AVX512F__
    if (e - s == 256) {
        __m512 vm = _mm512_setzero_ps(), vv = _mm512_setzero_ps();
        const __m512 ms = _mm512_set1_ps(msc), vs = _mm512_set1_ps(vsc);
        for (; i < e; i += 16) {
            const __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), _mm512_set1_ps(k->coef));
            const __m512i qm = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mq + i)));
            const __m512i qv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(vq + i)));
            const __m512 mi = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_i32gather_ps(qm, mcode, 4), ms),
                                                          _mm512_set1_ps(k->b1)), _mm512_mul_ps(_mm512_set1_ps(k->a1), gi));
            const __m512 vi = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_i32gather_ps(qv, vcode, 4), vs),
                                                          _mm512_set1_ps(k->b2)),
                                            _mm512_mul_ps(_mm512_set1_ps(k->a2), _mm512_mul_ps(gi, gi)));
            const __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(k->c2)),
                                             _mm512_set1_ps(k->eps));
            const __m512 pi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(p + i), _mm512_set1_ps(k->decay)),
                                            _mm512_mul_ps(_mm512_set1_ps(k->step), _mm512_div_ps(mi, den)));
            _mm512_storeu_ps(p + i, pi);
            _mm512_storeu_ps(m + (i - s), mi);
            _mm512_storeu_ps(v + (i - s), vi);
            vm = _mm512_max_ps(vm, _mm512_abs_ps(mi));
            vv = _mm512_max_ps(vv, vi);
        }
        mmax = _mm512_reduce_max_ps(vm);
        vmax = _mm512_reduce_max_ps(vv);
    }
#endif
    for (; i < e; i++) {
        const float gi = g[i] * k->coef;
        const float mi = mcode[mq[i]] * msc * k->b1 + k->a1 * gi;
        const float vi = vcode[vq[i]] * vsc * k->b2 + k->a2 * (gi * gi);
        p[i] = p[i] * k->decay + k->step * (mi / (sqrtf(vi) / k->c2 + k->eps));
        m[i - s] = mi; v[i - s] = vi;
        const float am = fabsf(mi);
        mmax = am > mmax ? am : mmax;
        vmax = vi > vmax ? vi : vmax;
    }
    *mmax_ = mmax; *vmax_ = vmax;
}

/* the nearest codes of m / md and v / vd (a nonzero v never code 0) for elements [s, e) */
static void codes(uint8_t* mq, uint8_t* vq, const float* m, const float* v, float md, float vd, int64_t s, int64_t e,
                  const int32_t* mtable, const float* mabove, const int32_t* vtable, const float* vabove) {
    int64_t i = s;
#ifdef __AVX512F__
    if (e - s == 256) {
        const __m512i mask = _mm512_set1_epi32(0x3FFFF), one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512();
        for (; i < e; i += 16) {
            const __m512 x = _mm512_div_ps(_mm512_loadu_ps(m + (i - s)), _mm512_set1_ps(md));
            const __m512i bm = _mm512_i32gather_epi32(_mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 14),
                                                                       mask), mtable, 4);
            const __m512i cm = _mm512_mask_add_epi32(bm, _mm512_cmp_ps_mask(x, _mm512_i32gather_ps(bm, mabove, 4),
                                                                            _CMP_GE_OQ), bm, one);
            _mm_storeu_si128((__m128i*)(mq + i), _mm512_cvtepi32_epi8(cm));
            const __m512 vv = _mm512_loadu_ps(v + (i - s));
            const __m512 y = _mm512_div_ps(vv, _mm512_set1_ps(vd));
            const __m512i bv = _mm512_i32gather_epi32(_mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(y), 14),
                                                                       mask), vtable, 4);
            __m512i cv = _mm512_mask_add_epi32(bv, _mm512_cmp_ps_mask(y, _mm512_i32gather_ps(bv, vabove, 4),
                                                                     _CMP_GE_OQ), bv, one);
            const __mmask16 floor = _mm512_cmp_ps_mask(vv, _mm512_setzero_ps(), _CMP_NEQ_UQ) &
                                    _mm512_cmpeq_epi32_mask(cv, zero);
            cv = _mm512_mask_mov_epi32(cv, floor, one);
            _mm_storeu_si128((__m128i*)(vq + i), _mm512_cvtepi32_epi8(cv));
        }
    }
#endif
    for (; i < e; i++) {
        mq[i] = (uint8_t)nearest(m[i - s] / md, mtable, mabove);
        const uint32_t c = nearest(v[i - s] / vd, vtable, vabove);
        vq[i] = (uint8_t)(v[i - s] != 0.0f && c < 1 ? 1 : c);
    }
}

/* blocks [b0, b1) of n elements; h: decay, step_size, c2, eps, b1, 1-b1, b2, 1-b2, coef; lut: the tables are
   bitsandbytes' CPU lookup tables (65536 entries) */
void adam8bit_update(float* p, const float* g, uint8_t* mq, float* ms, uint8_t* vq, float* vs,
                     int64_t n, int64_t b0, int64_t b1, const float* h,
                     const float* mcode, const int32_t* mtable, const float* mabove,
                     const float* vcode, const int32_t* vtable, const float* vabove, int lut) {
    hyper_t k; memcpy(&k, h, sizeof k);
    float m[256], v[256];
    for (int64_t b = b0; b < b1; b++) {
        const int64_t s = b * 256, e = s + 256 < n ? s + 256 : n;
        float mmax, vmax;
        moments(p, g, mq, vq, ms[b], vs[b], s, e, &k, mcode, vcode, m, v, &mmax, &vmax);
        if (lut) {
            const float mi = 1.0f / (mmax > 0.0f ? mmax : 1.0f), vi = 1.0f / (vmax > 0.0f ? vmax : 1.0f);
            for (int64_t i = s; i < e; i++) {
                mq[i] = mmax > 0.0f ? lookup(m[i - s] * mi, mtable) : 0;
                vq[i] = vmax > 0.0f ? lookup(v[i - s] * vi, vtable) : 0;
            }
        } else {
            codes(mq, vq, m, v, mmax > 0.0f ? mmax : 1.0f, vmax > 0.0f ? vmax : 1.0f, s, e, mtable, mabove,
                  vtable, vabove);
        }
        ms[b] = mmax; vs[b] = vmax;
    }
}
"""
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]


def flags() -> list[str]:
    """FLAGS, without AVX-512 where torch runs without it (a CPU without it, or ATEN_CPU_CAPABILITY capping
    torch at avx2 or default): the loop then takes its scalar path, as on such a CPU."""
    return FLAGS if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16") else [*FLAGS, "-mno-avx512f"]
_lock = threading.Lock()
_lib: list = []  # [the loaded library or None] once tried
_pool: list[ThreadPoolExecutor] = []


def cache_dir() -> Path:
    return Path(os.environ.get("PHANTOM_CACHE") or Path.home() / ".cache" / "phantom") / "kernels"


def library_path(compiler: str) -> Path:
    """Where the library of this source, these flags, this compiler and this CPU is kept."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\n".join([SOURCE, *flags(), *version, platform.machine(), _cpu_flags()]).encode())
    return cache_dir() / f"adam8bit-{key.hexdigest()[:16]}.so"


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def build(compiler: str) -> Path:
    """The library, compiled once into the cache (a lock keeps processes from compiling it together)."""
    path = library_path(compiler)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with fileio.locked(path.with_suffix(".lock")):
        if not path.is_file():
            source = path.with_suffix(".c")
            fileio.atomic_write_text(source, SOURCE)
            with fileio.replacing(path) as tmp:
                subprocess.run([compiler, *flags(), "-o", str(tmp), str(source)], check=True, capture_output=True,
                               text=True, timeout=120)
    return path


def load():
    """The compiled update (a ctypes function), or None where no C compiler can build it (said once)."""
    with _lock:
        if not _lib:
            _lib.append(_load())
        return _lib[0]


def _load():
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("8-bit AdamW: no C compiler (cc, gcc or $CC): its CPU update runs in torch, several times slower")
        return None
    try:
        fn = ctypes.CDLL(str(build(compiler))).adam8bit_update
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("8-bit AdamW: compiling its CPU update failed (%s); it runs in torch, several times slower",
                    " ".join(str(detail).split())[:300])
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 7 + [ctypes.c_int]
    return fn


def run(fn, p: torch.Tensor, g: torch.Tensor, moments: tuple[torch.Tensor, ...], h: torch.Tensor,
        tables: tuple[torch.Tensor, ...], lut: bool) -> None:
    """The update of flat contiguous CPU tensors (p fp32, g fp32, moments: the codes (uint8) and scales
    (fp32) of m, then of v) over every core: contiguous ranges of blocks, one thread each. tables: the
    maps' codes, int32 tables (or lookup tables) and thresholds, signed first, all contiguous."""
    n = p.numel()
    blocks = -(-n // 256)
    workers = max(1, min(torch.get_num_threads(), blocks // 64 or 1))
    ptrs = [t.data_ptr() for t in (p, g, *moments)]
    rest = [h.data_ptr(), *(t.data_ptr() for t in tables), int(lut)]
    edges = [blocks * k // workers for k in range(workers + 1)]
    if workers == 1:
        fn(*ptrs, n, 0, blocks, *rest)
        return
    pool = _workers(workers)
    for f in [pool.submit(fn, *ptrs, n, a, b, *rest) for a, b in zip(edges, edges[1:])]:
        f.result()


def _workers(n: int) -> ThreadPoolExecutor:
    with _lock:
        if not _pool or _pool[0]._max_workers < n:
            _pool[:] = [ThreadPoolExecutor(n, thread_name_prefix="adam8bit")]
        return _pool[0]
