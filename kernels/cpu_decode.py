"""Decode attention (one query token) on CPU over DecodeSegments.

Exact and Recent segments are a few pages: plain torch ops. The Mid segment (where the bytes
are) runs in a small C++ kernel (kernels/csrc/mid_decode.cpp) built once per source, compiler
flags and CPU by ``torch.utils.cpp_extension`` and cached by it. The kernel releases the GIL, so
splits of rows run on torch's thread count of Python threads. For each split of 1024 rows and
every kv-head at once it unpacks each row's packed codes in registers, folds the page's key
statistics into the projected query (q_r * scale_r, q . offset: recomputed only when the page
changes), so a logit is one short dot with the raw codes; a two-pass softmax within the split
then accumulates the weighted value *codes* per page and applies the page's value statistics
once per page. Splits and segments are merged by log-sum-exp; the Mid output is projected back
(``@ B_v^T + mean_v``) once per query head. No [N, C] float matrix is ever built: the kernel
reads N * C * bits / 8 bytes of codes plus one statistics row per page. An unprojected Mid
(KIVI-style codes of the keys/values themselves) is the same computation on an identity basis:
the query projection and the back-projection are skipped, and its per-token value statistics
are folded into the softmax weights instead of applied per page. Without the kernel
(no compiler, a failed build: warned once, or KVTOPO_NO_CKERNEL set) the Mid segment falls back
to the torch reference (dequantize + ``partial_lowrank``): slower, same result.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from .compressed_attention import merge_partials, partial_dense, partial_lowrank
from .decode_inputs import DecodeSegments, MidCodes, check_softcap

SOURCE = Path(__file__).with_name("csrc") / "mid_decode.cpp"
# The parts of -ffast-math the kernel can take: not -ffinite-math-only, under which its running
# max starting at -INFINITY may be miscompiled. Reassociation lets the compiler vectorize the dots.
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math", "-ffp-contract=fast"]
ROWS_PER_SPLIT = 1024  # a split's logits stay in L2


def _cpu_identity() -> str:
    """What -march=native compiles for (model and feature flags): a build for one CPU must not be
    loaded on another that shares the cache directory."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")
        described = "\n".join(dict.fromkeys(line for line in lines if line.startswith(wanted)))
    except OSError:
        described = ""
    described = described or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(described.encode()).hexdigest()[:12]


_KERNEL_LOCK = threading.Lock()


def mid_kernel():
    """The built Mid kernel module, or None (KVTOPO_NO_CKERNEL set, or the build failed: warned
    once with the compiler's message)."""
    with _KERNEL_LOCK:
        return _build()


@functools.cache
def _build():
    if os.environ.get("KVTOPO_NO_CKERNEL"):
        return None
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    # The vector expf the source declares on x86-64 glibc lives in libmvec.
    ldflags = ["-lmvec"] if platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc" else []
    try:
        # cpp_extension rebuilds when the source or flags change; the name separates CPUs.
        return cpp_extension.load(name=f"kvtopo_mid_decode_{_cpu_identity()}", sources=[str(SOURCE)],
                                  extra_cflags=CFLAGS, extra_ldflags=ldflags)
    except (OSError, RuntimeError, ImportError) as error:
        warnings.warn(f"kvtopo: building the CPU decode kernel {SOURCE.name} failed, so Mid segments use the "
                      f"torch reference (slower, same result):\n{error}", RuntimeWarning, stacklevel=3)
        return None


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the `ninja` package (a dependency) installs it in the
    environment's bin directory, which is not on PATH when a script runs as .venv/bin/python."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # the build fails and says that ninja is missing
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def c_kernel_available() -> bool:
    return mid_kernel() is not None


_POOL: ThreadPoolExecutor | None = None


def _pool(threads: int) -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None or _POOL._max_workers < threads - 1:
        _POOL = ThreadPoolExecutor(max_workers=max(1, threads - 1), thread_name_prefix="kvtopo-decode")
    return _POOL


def _dense_partial(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """(out [Hq, dv], lse [Hq]) of q [Hq, d] over k [Hkv, n, d], v [Hkv, n, dv], float32."""
    out, lse = partial_dense(q[:, None], k, v, scale, softcap=softcap)
    return out[:, 0], lse[:, 0]


def cpu_decode_attention(q: Tensor, segs: DecodeSegments, scale: float, softcap: float | None = None) -> Tensor:
    check_softcap(softcap)
    parts = []
    if segs.exact is not None and segs.exact[0].shape[1]:
        parts.append(_dense_partial(q, *segs.exact, scale, softcap))
    if segs.recent is not None and segs.recent.tokens:
        parts.append(_dense_partial(q, *segs.recent.decode(), scale, softcap))
    if segs.mid is not None and segs.mid.tokens:
        parts.append(mid_partial_cpu(q, segs.mid, scale, softcap))
    elif segs.mid_other is not None:
        attend = partial_lowrank if segs.mid_other_projected else partial_dense
        out, lse = attend(q[:, None], *segs.mid_other, scale, softcap=softcap)
        parts.append((out[:, 0], lse[:, 0]))
    for epoch in segs.retired:
        if isinstance(epoch, MidCodes):
            parts.append(mid_partial_cpu(q, epoch, scale, softcap))
        else:
            out, lse = partial_lowrank(q[:, None], *epoch, scale, softcap=softcap)
            parts.append((out[:, 0], lse[:, 0]))
    if not parts:
        raise ValueError("decode attention over an empty history")
    return merge_partials(parts)


def mid_partial_cpu(q: Tensor, mid: MidCodes, scale: float, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """(out [Hq, dv], lse [Hq]) of q [Hq, d] over a quantized Mid segment
    (``softcap``: capped logits; passed to the kernel as a float, 0 meaning none)."""
    kernel = mid_kernel()
    if kernel is None:
        keys, values = mid.decode()
        out, lse = partial_lowrank(q[:, None], keys, values, scale, softcap=softcap)
        return out[:, 0], lse[:, 0]
    hkv, rv = mid.kv_heads, mid.value_width
    hq = q.shape[0]
    g = hq // hkv
    qp, qb = mid.query_terms(q, scale)  # [Hkv, G, Rk], [Hkv, G]
    splits = max(1, -(-mid.tokens // ROWS_PER_SPLIT))
    coef = torch.empty(splits, hkv, g, rv)
    lse = torch.empty(splits, hkv, g)
    codes = [x.contiguous() for x in (mid.k_rows, mid.k_scale, mid.k_offset, mid.k_starts, mid.k_ranks)]
    codes.append(mid.k_bits)
    codes += [x.contiguous() for x in (mid.v_rows, mid.v_scale, mid.v_offset, mid.v_starts, mid.v_ranks)]
    codes += [mid.v_bits, mid.value_stats_per_row, mid.row_stat.contiguous(), coef, lse]
    cap = 0.0 if softcap is None else float(softcap)
    threads = torch.get_num_threads()
    if threads == 1 or splits == 1:
        kernel.mid_decode(qp, qb, 0, splits, cap, *codes)
    else:  # the kernel releases the GIL: the worker threads run it in parallel
        bounds = [splits * i // threads for i in range(threads + 1)]
        futures = [_pool(threads).submit(kernel.mid_decode, qp, qb, a, b, cap, *codes)
                   for a, b in zip(bounds[1:-1], bounds[2:])]
        kernel.mid_decode(qp, qb, bounds[0], bounds[1], cap, *codes)
        for f in futures:
            f.result()
    # merge splits (coefficient domain, linear), then project back once per query head
    m = lse.amax(0, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)  # [S, Hkv, G]
    total = w.sum(0)
    mixed = (w[..., None] * coef).sum(0) / total.clamp_min(1e-38)[..., None]  # [Hkv, G, Rv]
    out = mid.values_out(mixed)
    return out.reshape(hq, -1), (m[0] + total.log()).reshape(hq)
