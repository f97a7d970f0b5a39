"""Decode attention (one query token per sequence) on CPU over DecodeSegments, for a batch of
sequences in one call (``cpu_decode_batch``; one sequence is a batch of one).

Every segment of every sequence — exact tokens, Recent pages, the Mid segment and earlier Mid
epochs — runs in one call of a small C++ kernel (kernels/csrc/mid_decode.cpp) built once per
source, compiler flags and CPU by ``torch.utils.cpp_extension`` and cached by it. Each is read
as stored: Mid as packed code rows (all kv-heads side by side) with per-page statistics, Recent
as each kv-head's code block, exact tokens as float32 "codes" with unit statistics (read in place
from the layer's page pool through the pages' slots when the pool is float32 or bfloat16, as
32- or 16-bit codes: ``PagedExact``). The kernel
releases the GIL and runs its work items, (segment, split of 1024 rows), on torch's intra-op
threads (``at::parallel_for``), each thread a run of items holding about the same number of rows.
For each split and every kv-head at once it unpacks each row's codes, folds the page's key
statistics into the projected query (q_r * scale_r, q . offset: recomputed only when the page
changes), so a logit is one short dot with the raw codes; a two-pass softmax within the split
then accumulates the weighted value *codes* per page and applies the page's value statistics
once per page (per-token value statistics are folded into the weights instead). A segment's
splits are merged in the kernel; a projected Mid's output is projected back
(``@ B_v^T + mean_v``) once per query head; the segments of all sequences are merged at once,
by the kernel's ``merge_parts``.
No [N, C] float matrix is ever built: the kernel reads N * C * bits / 8 bytes of codes plus
one statistics row per page. An unprojected Mid (KIVI-style codes of the keys/values
themselves) and Recent pages are the same computation on an identity basis. Without the
kernel (no compiler, a failed build: warned once, or KVTOPO_NO_CKERNEL set) Mid segments fall
back to the torch reference (dequantize + ``partial_lowrank``) and exact + Recent tokens to one
padded torch attention: slower, same result.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import platform
import shutil
import threading
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from .compressed_attention import merge_partials, partial_dense, partial_lowrank
from .decode_inputs import DecodeSegments, MidCodes, PagedExact, RecentCodes, check_softcap, rank_columns


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


def build_kernel(source: Path | None = None, name: str = "kvtopo_mid_decode", cflags: Sequence[str] = CFLAGS):
    """Compile and load a kernel source (None: `SOURCE`) as a module; `name` (suffixed by the CPU's
    identity) is its build directory and module name. Raises when the build fails.
    bench/kernel_ab.py builds other revisions of the source with it; kernels/quant.py its own
    source, with IEEE flags."""
    from torch.utils import cpp_extension

    source = SOURCE if source is None else source
    _put_ninja_on_path()
    # The vector expf the source declares on x86-64 glibc lives in libmvec.
    ldflags = ["-lmvec"] if platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc" else []
    # at::parallel_for runs on torch's OpenMP threads only when the kernel is built with OpenMP
    # (it then shares torch's libgomp, already loaded); otherwise it runs the work items serially.
    openmp = ["-fopenmp"] if torch._C.has_openmp else []
    # cpp_extension rebuilds when the source or flags change; the name separates CPUs.
    return cpp_extension.load(name=f"{name}_{_cpu_identity()}", sources=[str(source)],
                              extra_cflags=list(cflags) + openmp, extra_ldflags=ldflags + openmp)


@functools.cache
def _build():
    return built_or_warned(SOURCE, "kvtopo_mid_decode", CFLAGS, "Mid segments use the torch reference")


def built_or_warned(source: Path, name: str, cflags: Sequence[str], instead: str):
    """`build_kernel(source, name, cflags)`, or None when KVTOPO_NO_CKERNEL is set or the build
    fails (warned with the compiler's message and what the caller does `instead`). Callers cache
    it, so a failure is reported once."""
    if os.environ.get("KVTOPO_NO_CKERNEL"):
        return None
    try:
        return build_kernel(source, name, cflags)
    except (OSError, RuntimeError, ImportError) as error:
        warnings.warn(f"kvtopo: building {source.name} failed, so {instead} (slower, same result):\n{error}",
                      RuntimeWarning, stacklevel=4)
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


def cpu_decode_attention(q: Tensor, segs: DecodeSegments, scale: float, softcap: float | None = None) -> Tensor:
    """One sequence: q [Hq, d] over its segments -> [Hq, dv] float32 (a batch of one)."""
    return cpu_decode_batch(q[None], [segs], scale, softcap)[0]


def cpu_decode_batch(q: Tensor, segs: Sequence[DecodeSegments], scale: float,
                     softcap: float | None = None) -> Tensor:
    """Decode attention of a batch, q [B, Hq, d] (one token per sequence) over each sequence's
    segments -> [B, Hq, dv] float32: every segment (exact tokens, Recent pages, Mid and Mid
    epochs) of every sequence in one C kernel call, then one log-sum-exp merge of all sequences.
    A sequence's row depends only on its own segments."""
    check_softcap(softcap)
    kernel = mid_kernel()
    parts: list[list[tuple[Tensor, Tensor]]] = [[] for _ in segs]  # per sequence: (out [Hq, dv], lse [Hq])
    coded: list[tuple[int, MidCodes]] = []
    for b, s in enumerate(segs):
        if s.mid is None and s.mid_other is not None:
            attend = partial_lowrank if s.mid_other_projected else partial_dense
            parts[b].append(_single(attend(q[b, :, None], *s.mid_other, scale, softcap=softcap)))
        current = (s.mid,) if s.mid is not None and s.mid.tokens and not (kernel and _batch_wide_mid(s)) else ()
        for epoch in current + tuple(s.retired):
            if isinstance(epoch, MidCodes):
                coded.append((b, epoch))
            else:
                parts[b].append(_single(partial_lowrank(q[b, :, None], *epoch, scale, softcap=softcap)))
    if kernel is None:
        for b, mid in coded:
            parts[b].append(_single(partial_lowrank(q[b, :, None], *mid.decode(), scale, softcap=softcap)))
        dense = _dense_batch(q, segs, scale, softcap)
        whole = [dense] if dense is not None else []
    else:
        whole = _kernel_partials(kernel, q, segs, coded, parts, scale, softcap)
    if not whole and not all(parts):
        raise ValueError("decode attention over an empty history")
    if kernel is not None:
        return _kernel_merge(kernel, whole, parts, q.shape[1])
    dv = (whole[0] if whole else parts[0][0])[0].shape[-1]
    unseen = (q.new_zeros(q.shape[1], dv, dtype=torch.float32),  # pads a sequence with fewer parts
              q.new_full((q.shape[1],), -float("inf"), dtype=torch.float32))
    slots = [tuple(torch.stack([(p[i] if i < len(p) else unseen)[j] for p in parts]) for j in (0, 1))
             for i in range(max(len(p) for p in parts))]  # slot i: every sequence's i-th part
    return merge_partials(whole + slots)


def _kernel_partials(kernel, q: Tensor, segs: Sequence[DecodeSegments], coded: Sequence[tuple[int, MidCodes]],
                     parts: list[list[tuple[Tensor, Tensor]]], scale: float,
                     softcap: float | None) -> list[tuple[Tensor, Tensor]]:
    """One kernel call over every exact (paged and explicit), Recent and coded Mid segment of the
    batch. Exact, Recent and current unprojected Mid results come back as batch-wide partials
    (out [B, Hq, dv], lse [B, Hq]; -inf where a sequence has none), written by the kernel
    straight into their rows; the other Mid epochs' (``coded``) go to ``parts[b]``. The scaled
    query and its zero mean term are made once for the batch: exact, Recent and an unprojected
    Mid read them as they are (an identity basis)."""
    batch, hq, d = q.shape
    heads = segs[0].kv_heads
    qs = q.float().mul(scale).reshape(batch, heads, hq // heads, d).contiguous()
    # Per-sequence views by one unbind each, not one Python index per segment (each ~µs).
    qs_rows, zero_rows = qs.unbind(0), _zero_query_terms(batch, heads, hq // heads)
    tensors: list[Tensor] = []
    ints: list[int] = []

    def add(seg_tensors: list[Tensor], seg_ints: list[int]) -> None:
        tensors.extend(seg_tensors)
        ints.extend(seg_ints)
        ints.append(max(1, -(-seg_ints[0] // ROWS_PER_SPLIT)))

    present = [(kind, args, rows, width(segs[rows[0]])) for kind, width, args in _BATCH_WIDE
               if (rows := [b for b, s in enumerate(segs) if width(s)])]
    whole = []
    if present:
        # One out and one lse buffer for every kind's rows: kind k's partial is slice k.
        widths = {dv for *_, dv in present}
        if len(widths) != 1:
            raise ValueError(f"a layer's segments disagree on the value width: {sorted(widths)}")
        dv, kinds = widths.pop(), len(present)
        full = all(len(rows) == batch for _, _, rows, _ in present)  # else missing rows must read as empty
        out = qs.new_empty(kinds * batch, heads, hq // heads, dv)  # rows with lse -inf are never read
        lse = qs.new_empty(out.shape[:3]) if full else qs.new_full(out.shape[:3], -float("inf"))
        out_rows, lse_rows = out.unbind(0), lse.unbind(0)
        for k, (kind, args, rows, _) in enumerate(present):
            for b in rows:
                add(*args(qs_rows[b], zero_rows[b], getattr(segs[b], kind), out_rows[k * batch + b],
                          lse_rows[k * batch + b]))
        whole = list(zip(out.view(kinds, batch, hq, dv).unbind(0), lse.view(kinds, batch, hq).unbind(0)))
    mids = []
    for b, mid in coded:
        qp, qb = mid.query_terms(q[b], scale) if mid.projected else (qs_rows[b], zero_rows[b])
        out, lse = qp.new_empty(*qp.shape[:2], mid.value_width), qp.new_empty(qp.shape[:2])
        add(*_codes_args(qp, qb, mid, out, lse))
        mids.append((b, mid, out, lse))
    if tensors:
        kernel.decode_segments(tensors, ints, torch.get_num_threads(), 0.0 if softcap is None else float(softcap))
    for b, mid, out, lse in mids:
        parts[b].append((mid.values_out(out).reshape(hq, -1), lse.reshape(-1)))
    return whole


class BatchArguments:
    """The kernel's arguments for the decode steps of one batch of sequences, kept between steps
    (runtime/decode_batch.py): each sequence's segments as ``_kernel_partials`` gives them to the
    kernel, in one flat list, pointing at buffers of scaled queries, outputs and log-sum-exps
    that live as long as the arguments. A step that moves no page changes only each sequence's
    count of exact rows (``advance``: one tensor op for the batch; the kernel derives the splits
    from the count, ``-ROWS_PER_SPLIT``) and the queries (one copy).

    Every kind of ``_BATCH_WIDE`` has a [B] block of outputs; a sequence without a segment of a
    kind keeps that row's lse at -inf, which the merge skips, so the kernel call and the merge
    are ``cpu_decode_batch``'s (the same bits). Only batch-wide segments are taken (exact pages
    read in place, Recent codes, an unprojected Mid): ``set_row`` refuses a sequence with others."""

    NEW_TOKEN = 1  # the kind (``_BATCH_WIDE``'s "exact") a step's new token is read as

    def __init__(self, batch: int, kv_heads: int, group: int, head_dim: int, value_dim: int,
                 scale: float, softcap: float | None):
        check_softcap(softcap)
        self.kernel = mid_kernel()
        if self.kernel is None:
            raise RuntimeError("BatchArguments needs the C decode kernel, which did not build")
        self.batch, self.q_heads, self.scale = batch, kv_heads * group, scale
        self.softcap = 0.0 if softcap is None else float(softcap)
        self.qs = torch.empty(batch, kv_heads, group, head_dim)
        self.qs_rows, self.zero_rows = self.qs.unbind(0), _zero_query_terms(batch, kv_heads, group)
        kinds = len(_BATCH_WIDE)
        self.out = torch.empty(kinds * batch, kv_heads, group, value_dim)
        self.lse = torch.full((kinds * batch, kv_heads, group), -float("inf"))
        self.out_rows, self.lse_rows = self.out.unbind(0), self.lse.unbind(0)
        self.parts = (list(self.out.view(kinds, batch, self.q_heads, value_dim).unbind(0)),
                      list(self.lse.view(kinds, batch, self.q_heads).unbind(0)), [0] * kinds)
        self.row_tensors: list[list[Tensor]] = [[] for _ in range(batch)]
        self.row_ints: list[list[int]] = [[] for _ in range(batch)]
        self.tensors: list[Tensor] = []
        self.ints = torch.zeros(0, dtype=torch.long)
        self.exact_at = torch.zeros(batch, dtype=torch.long)  # where each exact-page count lies in ints
        self._ones = torch.ones(batch, dtype=torch.long)
        self._set: set[int] = set()  # rows set since the last flatten
        self._tensor_at: list[int] = []  # where each row's tensors start in `tensors` (and the last ends)
        self._ints_at: list[int] = []  # where each row's ints start in `ints` (and the last ends)

    def set_row(self, b: int, segs: DecodeSegments) -> bool:
        """Sequence b's segments (its new token not among them); False, and nothing changed, when
        one is not batch-wide or its exact pages are not read in place. ``flatten`` after."""
        if (segs.exact_pages is None or not segs.exact_pages.tokens or segs.exact is not None
                or segs.mid_other is not None or segs.retired or (segs.mid is not None and not _batch_wide_mid(segs))):
            return False
        tensors, ints = [], []
        for k, (kind, width, args) in enumerate(_BATCH_WIDE):
            if width(segs):
                seg_tensors, seg_ints = args(self.qs_rows[b], self.zero_rows[b], getattr(segs, kind),
                                             self.out_rows[k * self.batch + b], self.lse_rows[k * self.batch + b])
                tensors += seg_tensors
                ints += seg_ints + [-ROWS_PER_SPLIT]
            else:
                self.lse_rows[k * self.batch + b].fill_(-float("inf"))
        self.row_tensors[b], self.row_ints[b] = tensors, ints
        self._set.add(b)
        return True

    def flatten(self) -> None:
        """The rows' arguments as the one list the kernel takes (after ``set_row``); the rows not
        set since the last call keep the exact counts ``advance`` brought them to. A set row whose
        arguments kept their length (its page moved, its segments' kinds did not change) is
        replaced in place, so a step that moves one sequence's page costs that sequence alone."""
        set_rows, self._set = sorted(self._set), set()
        if self.tensors and all(len(self.row_tensors[b]) == self._tensor_at[b + 1] - self._tensor_at[b]
                                and len(self.row_ints[b]) == self._ints_at[b + 1] - self._ints_at[b] for b in set_rows):
            for b in set_rows:
                self.tensors[self._tensor_at[b]: self._tensor_at[b + 1]] = self.row_tensors[b]
                self.ints[self._ints_at[b]: self._ints_at[b + 1]] = torch.tensor(self.row_ints[b])
            return
        ints, at = self.ints, self.exact_at
        kept = torch.tensor([b for b in range(self.batch) if b not in set_rows], dtype=torch.long)
        self.tensors = list(itertools.chain.from_iterable(self.row_tensors))
        self.ints = torch.tensor(list(itertools.chain.from_iterable(self.row_ints)), dtype=torch.long)
        self._tensor_at = [0, *itertools.accumulate(map(len, self.row_tensors))]
        self._ints_at = [0, *itertools.accumulate(map(len, self.row_ints))]
        self.exact_at = torch.tensor(self._ints_at[:-1], dtype=torch.long)
        if ints.numel():
            self.ints[self.exact_at[kept]] = ints[at[kept]]

    def advance(self, rows: Tensor | None = None) -> None:
        """One more exact token for the sequences `rows` (None: every sequence)."""
        at = self.exact_at if rows is None else self.exact_at[rows]
        self.ints.index_add_(0, at, self._ones[: at.numel()])

    def attend(self, q: Tensor, new_tokens: Sequence[tuple[int, Tensor, Tensor]] = ()) -> Tensor:
        """q [B, Hq, d] over every sequence's segments, plus for each (b, key, value) of
        `new_tokens` that token (key/value [Hkv, 1, d]: a sequence whose token is not stored yet)
        -> [B, Hq, dv] float32."""
        self.qs.copy_(q.reshape(self.qs.shape)).mul_(self.scale)
        if not new_tokens:
            return self._attend(self.tensors, self.ints)
        tensors, ints = list(self.tensors), self.ints.tolist()
        for b, key, value in new_tokens:
            seg_tensors, seg_ints = _exact_args(self.qs_rows[b], self.zero_rows[b], (key, value),
                                                self.out_rows[self.batch + b], self.lse_rows[self.batch + b])
            tensors += seg_tensors
            ints += seg_ints + [-ROWS_PER_SPLIT]
        merged = self._attend(tensors, ints)
        self.lse[[self.NEW_TOKEN * self.batch + b for b, _, _ in new_tokens]] = -float("inf")  # empty again
        return merged

    def step(self, q: Tensor, k: Tensor, v: Tensor, pool_rows: tuple[Tensor, Tensor], next_rows: Tensor,
             ring: Tensor | None) -> Tensor:
        """A step in which every sequence's token lands in place (q [B, Hq, 1, d], k/v [B, Hkv, 1,
        d], last dimensions contiguous): one kernel call writes the tokens into the pool rows
        `next_rows` [B, Hkv] of `pool_rows` ([rows, d] each) and advances them, advances the
        exact counts (`advance`), scales q and keeps it in `ring` [B, Hq, d] float16 if given;
        then `attend` -> [B, Hq, dv] float32."""
        self.kernel.begin_step(q, self.scale, self.qs, k, v, *pool_rows, next_rows, self.ints, self.exact_at, ring)
        return self._attend(self.tensors, self.ints)

    def _attend(self, tensors: list[Tensor], ints: Tensor | list[int]) -> Tensor:
        self.kernel.decode_segments(tensors, ints, torch.get_num_threads(), self.softcap)
        merged = self.out.new_empty(self.batch * self.q_heads, self.out.shape[-1])
        self.kernel.merge_parts(*self.parts, merged)
        return merged.view(self.batch, self.q_heads, -1)


@functools.lru_cache(maxsize=16)
def _zero_query_terms(batch: int, heads: int, group: int) -> tuple[Tensor, ...]:
    """Each sequence's zero mean term [Hkv, G] of an identity basis: read-only for the kernel,
    so one buffer per shape serves every call."""
    return torch.zeros(batch, heads, group).unbind(0)


def _batch_wide_mid(s: DecodeSegments) -> bool:
    """Whether the current Mid epoch is read on an identity basis, so that its result needs no
    per-sequence projection back and joins the batch-wide partials."""
    return isinstance(s.mid, MidCodes) and not s.mid.projected


def _kernel_merge(kernel, whole: list[tuple[Tensor, Tensor]], parts: list[list[tuple[Tensor, Tensor]]],
                  hq: int) -> Tensor:
    """``merge_partials`` of the batch-wide partials (out [B, Hq, dv], lse [B, Hq]) and each
    sequence's own ([Hq, dv], [Hq]) in one kernel call -> [B, Hq, dv]: the torch merge's
    handful of ops per layer cost more than the kernel's attention over a short history."""
    outs, lses, first = [], [], []
    for out, lse in whole:
        outs.append(out), lses.append(lse), first.append(0)
    for b, own in enumerate(parts):
        for out, lse in own:
            outs.append(out), lses.append(lse), first.append(b * hq)
    dv = outs[0].shape[-1]
    merged = outs[0].new_empty(len(parts) * hq, dv, dtype=torch.float32)
    kernel.merge_parts([_float32(x) for x in outs], [_float32(x) for x in lses], first, merged)
    return merged.view(len(parts), hq, dv)


def _float32(x: Tensor) -> Tensor:
    """x as a contiguous float32 tensor (the kernel's own partials already are: no call)."""
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def _single(part: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """A torch partial of one query token, (out [Hq, 1, dv], lse [Hq, 1]) -> ([Hq, dv], [Hq])."""
    return part[0][:, 0], part[1][:, 0]


def _dense_batch(q: Tensor, segs: Sequence[DecodeSegments], scale: float,
                 softcap: float | None) -> tuple[Tensor, Tensor] | None:
    """Without the C kernel: (out [B, Hq, dv], lse [B, Hq]) over every sequence's exact tokens
    and Recent tokens (all sequences' Recent codes decoded by one call), placed in one
    [Hkv, B, L, d] buffer padded to the longest sequence and attended at once with the padding
    masked (None: no such tokens)."""
    recents = [s.recent for s in segs if s.recent is not None and s.recent.tokens]
    decoded = RecentCodes.concat(recents).decode() if recents else None
    pieces, lengths, at = [], [], 0  # per sequence: its (keys, values) pieces
    for s in segs:
        exact = s.exact_kv()
        own = [exact] if exact is not None and exact[0].shape[1] else []
        if s.recent is not None and s.recent.tokens:
            own.append((decoded[0][:, at: at + s.recent.tokens], decoded[1][:, at: at + s.recent.tokens]))
            at += s.recent.tokens
        pieces.append(own)
        lengths.append(sum(k.shape[1] for k, _ in own))
    longest = max(lengths)
    if longest == 0:
        return None
    batch, hq, _ = q.shape
    first = next(own[0] for own in pieces if own)
    hkv = first[0].shape[0]
    padded = [q.new_zeros(hkv, batch, longest, x.shape[-1], dtype=torch.float32) for x in first]
    for b, own in enumerate(pieces):
        start = 0
        for k, v in own:  # copied (and converted to float32) straight into the padded buffers
            padded[0][:, b, start: start + k.shape[1]] = k
            padded[1][:, b, start: start + k.shape[1]] = v
            start += k.shape[1]
    padded = [x.view(hkv * batch, longest, -1) for x in padded]
    n = torch.tensor(lengths)
    visible = (torch.arange(longest) < n[:, None]).to(q.device)  # [B, L]
    mask = visible[None].expand(hkv, batch, longest).reshape(hkv * batch, 1, 1, longest)
    # rows ordered (kv-head, sequence, group): each (kv-head, sequence) pair is one "kv-head" here
    qh = q.float().reshape(batch, hkv, hq // hkv, -1).transpose(0, 1).reshape(hq * batch, 1, -1)
    out, lse = partial_dense(qh, *padded, scale, mask, softcap)
    out = out.reshape(hkv, batch, hq // hkv, -1).transpose(0, 1).reshape(batch, hq, -1)
    return out, lse.reshape(hkv, batch, hq // hkv).transpose(0, 1).reshape(batch, hq)


_LAYOUTS: "weakref.WeakKeyDictionary[MidCodes | RecentCodes, tuple[list[Tensor], list[int]]]" = \
    weakref.WeakKeyDictionary()


def _codes_args(qp: Tensor, qb: Tensor, codes: MidCodes | RecentCodes, out: Tensor,
                lse: Tensor) -> tuple[list[Tensor], list[int]]:
    """A Mid or Recent segment as the kernel reads it (see ``decode_segments`` in
    csrc/mid_decode.cpp): qp [Hkv, G, R], qb [Hkv, G] its query terms, then its codes' layout,
    built once per codes object (the same at every decode step until the store replaces the
    object: rows appended, the Recent window moved), then its outputs."""
    held = _LAYOUTS.get(codes)
    if held is None:
        build = _mid_codes_layout if isinstance(codes, MidCodes) else _recent_codes_layout
        held = _LAYOUTS[codes] = build(codes)
    middle, ints = held
    return [qp, qb, *middle, out, lse], ints


def _mid_codes_layout(mid: MidCodes) -> tuple[list[Tensor], list[int]]:
    """Each code row one run of every head's codes side by side, statistics per page, values'
    per row and head when quantized per token."""
    n, heads = mid.tokens, mid.kv_heads
    sides, ints = [], [n]
    for rows, stat_scale, offset, starts, ranks, bits, per_row in (
            (mid.k_rows, mid.k_scale, mid.k_offset, mid.k_starts, mid.k_ranks, mid.k_bits, False),
            (mid.v_rows, mid.v_scale, mid.v_offset, mid.v_starts, mid.v_ranks, mid.v_bits, mid.value_stats_per_row)):
        width = rows.shape[1] * 8 // bits if per_row else stat_scale.shape[1]  # codes per row
        sides += [rows, stat_scale, offset, starts, ranks, _NOT_PAGED]
        ints += [bits, 1, width, rows.shape[1], 0, *((heads, 1) if per_row else (width, 0)), int(per_row), 0, 0]
    return [*(x.contiguous() for x in sides), mid.row_stat.contiguous()], ints


def _recent_codes_layout(recent: RecentCodes) -> tuple[list[Tensor], list[int]]:
    """Recent pages on an identity basis (qp the scaled query, qb zeros): each kv-head's codes a
    run of its own [Nr, bytes] block, key statistics per page and channel, value statistics per
    token."""
    heads, n = recent.k_codes.shape[:2]
    k_starts, k_ranks, v_starts, v_ranks, row_stat = _recent_layout(heads, recent.dk, recent.dv, n, recent.page_size)
    pages = recent.k_scale.shape[1]
    tensors = [recent.k_codes.contiguous(), recent.k_scale.contiguous(), recent.k_offset.contiguous(), k_starts,
               k_ranks, _NOT_PAGED,
               recent.v_codes.contiguous(), recent.v_scale.contiguous(), recent.v_offset.contiguous(), v_starts,
               v_ranks, _NOT_PAGED, row_stat]
    k_bytes, v_bytes = recent.k_codes.shape[2], recent.v_codes.shape[2]
    ints = [n,
            recent.bits, heads, recent.dk, k_bytes, n * k_bytes, recent.dk, pages * recent.dk, 0, 0, 0,
            recent.bits, heads, recent.dv, v_bytes, n * v_bytes, 1, n, 1, 0, 0]
    return tensors, ints


def _exact_args(qp: Tensor, qb: Tensor, exact: tuple[Tensor, Tensor], out: Tensor,
                lse: Tensor) -> tuple[list[Tensor], list[int]]:
    """Exact tokens (keys [Hkv, N, dk], values [Hkv, N, dv]) as the kernel reads them: float32
    "codes" 32 bits wide, each kv-head a run of its own, on an identity basis (qp the scaled
    query, qb zeros) with statistics scale 1, offset 0 (one row, read for every page)."""
    keys, values = (x.float().contiguous() for x in exact)
    heads, n, dk = keys.shape
    dv = values.shape[2]
    k_starts, k_ranks, v_starts, v_ranks, k_ones, k_zeros, v_ones, v_zeros = _exact_layout(heads, dk, dv)
    tensors = [qp, qb, keys.view(torch.uint8), k_ones, k_zeros, k_starts, k_ranks, _NOT_PAGED,
               values.view(torch.uint8), v_ones, v_zeros, v_starts, v_ranks, _NOT_PAGED, _zero_rows(n), out, lse]
    ints = [n, 32, heads, dk, 4 * dk, 4 * n * dk, 0, 0, 0, 0, 0, 32, heads, dv, 4 * dv, 4 * n * dv, 0, 0, 0, 0, 0]
    return tensors, ints


def _paged_exact_args(qp: Tensor, qb: Tensor, pages: PagedExact, out: Tensor,
                      lse: Tensor) -> tuple[list[Tensor], list[int]]:
    """Exact tokens read in place from the layer's page pool (keys [S, Hkv, P, dk], float32 or
    bfloat16: 32- or 16-bit "codes"): as ``_exact_args``, each row one run per kv-head (a head's
    P rows of a slot are P * dk values apart), rows found through the pages' slots."""
    slots, (_, heads, page, dk), dv = pages.slots, pages.keys.shape, pages.values.shape[-1]
    size = pages.keys.element_size()
    k_starts, k_ranks, v_starts, v_ranks, k_ones, k_zeros, v_ones, v_zeros = _exact_layout(heads, dk, dv)
    # row_stat covers the pages' capacity, so that the arguments of a page still filling stay
    # valid as its rows grow (`BatchArguments`).
    tensors = [qp, qb, pages.keys.view(torch.uint8), k_ones, k_zeros, k_starts, k_ranks, slots,
               pages.values.view(torch.uint8), v_ones, v_zeros, v_starts, v_ranks, slots,
               _zero_rows(slots.numel() * page), out, lse]
    ints = [pages.tokens,
            8 * size, heads, dk, size * dk, size * page * dk, 0, 0, 0, page, size * heads * page * dk,
            8 * size, heads, dv, size * dv, size * page * dv, 0, 0, 0, page, size * heads * page * dv]
    return tensors, ints


# The segments read into batch-wide partials: (DecodeSegments field, its value width in a
# sequence's segments (falsy: none to read), its kernel arguments).
_BATCH_WIDE = (
    ("exact_pages", lambda s: s.exact_pages is not None and s.exact_pages.tokens and s.exact_pages.values.shape[-1],
     _paged_exact_args),
    ("exact", lambda s: s.exact is not None and s.exact[0].shape[1] and s.exact[1].shape[-1], _exact_args),
    ("recent", lambda s: s.recent is not None and s.recent.tokens and s.recent.dv, _codes_args),
    ("mid", lambda s: _batch_wide_mid(s) and s.mid.tokens and s.mid.value_width, _codes_args),
)


@functools.lru_cache(maxsize=64)
def _exact_layout(heads: int, dk: int, dv: int) -> tuple[Tensor, ...]:
    """Head columns of exact tokens and their unit statistics (ones and zeros of dk, then of dv)."""
    return (*rank_columns((dk,) * heads), *rank_columns((dv,) * heads),
            torch.ones(dk), torch.zeros(dk), torch.ones(dv), torch.zeros(dv))


_ZERO_ROWS = torch.zeros(0, dtype=torch.int32)
_NOT_PAGED = torch.zeros(0, dtype=torch.int32)  # a side's slots when its rows are consecutive


def _zero_rows(n: int) -> Tensor:
    """row_stat of n exact tokens (all read statistics row 0): a slice of one shared buffer that
    only grows (the kernel never writes it)."""
    global _ZERO_ROWS
    if _ZERO_ROWS.numel() < n:
        _ZERO_ROWS = torch.zeros(max(n, 2 * _ZERO_ROWS.numel()), dtype=torch.int32)
    return _ZERO_ROWS[:n]


@functools.lru_cache(maxsize=64)
def _recent_layout(heads: int, dk: int, dv: int, tokens: int, page_size: int) -> tuple[Tensor, ...]:
    """Head columns (starts, ranks for keys and values) and row_stat (each token's page) of
    Recent pages: constant for a layer's shapes, so built once."""
    k_starts, k_ranks = rank_columns((dk,) * heads)
    v_starts, v_ranks = rank_columns((dv,) * heads)
    return k_starts, k_ranks, v_starts, v_ranks, torch.arange(tokens, dtype=torch.int32) // page_size
