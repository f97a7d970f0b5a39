"""Run an exported kvtopo model: the host side of the two exported graphs, on any runtime.

`export.export_onnx` writes `decode_step.onnx` (tokens + the compressed cache as explicit tensors
-> logits + each layer's new K/V and queries), `compressor.onnx` (one page's K/V + observation
queries + head bases -> kept tokens, codes, statistics; exponential-free) and `layout.json`
(capacities and the kvtopo Config); `export.export_iree` writes the same two graphs as IREE
modules. `HostRunner` keeps the cache on the host and drives both through an executor
(`export.executors`: onnxruntime, OpenVINO or IREE, one `run(graph, inputs) -> outputs` each):

* every lifecycle decision (where tokens go, which pages move and when, the budget, how many
  tokens a Mid page keeps) is made by `runtime.lifecycle.Lifecycle`, the code the PyTorch store
  runs; each layer here implements only its hooks over host tensors, counting the same bytes;
* Recent pages are encoded on the host with `runtime.codecs.encode_recent` (the same int8 code as
  the session; a per-page min/max, cheap on any host CPU);
* Mid pages go through the exported compressor graph (score, select, project, quantize; or,
  unprojected, KIVI-style codes with key statistics per page and channel and value statistics per
  row, held in [Hkv, M] buffers);
* principal directions are fitted on the host with `runtime.codecs.fit_bases` (an SVD: not a
  graph an NPU toolchain wants), once per layer, on the same tokens and at the same moment as
  the session (when the first page is about to reach Mid, on everything held plus the chunk).

MLA layouts (`layout.shared_value_dim` set: DeepSeek-V2/V3) hold one kv-head of [latent ; RoPE key]
per token whose value is the latent, as `runtime.layer_cache.LayerCache` with `shared_value_dim`:
no values are stored, Recent pages code only keys, Mid pages go through the keys-only compressor
and only key bases are fitted.

Under the "npu" export profile (export/layout.py) every float buffer here is float16 (what the
graphs take and return), the decode step takes exactly `layout.tokens` (1) tokens per call, so the
prompt is fed one token per call, and a sequence stops at `layout.max_context`. Pages keep the
float16 outputs as float32 values (exact) for the lifecycle and the host-side codecs; `nbytes`
counts what the float32 session would hold, so budgets evict at the same points.

Batch 1. Differences from the PyTorch session are float rounding only: the graphs compute the
same functions from the same inputs, but each runtime's kernels round differently (~1e-7), so a
quantization code sitting on a rounding boundary, or two tokens whose scores tie to ~1e-7, can
land differently. Exact ties at an eviction cut go to the lower token index here; torch.topk
leaves their order unspecified.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvtopo.config import Config
from kvtopo.runtime.codecs import HeadBases, MidSegment, RecentPage, encode_recent, fit_bases
from kvtopo.runtime.lifecycle import Lifecycle, PageState, SequenceState, check_value_energy
from kvtopo.runtime.phases import Phase
from kvtopo.runtime.policies import make_policy

from .attention import BASIS_TENSORS
from .decode_step import cache_shapes, mid_axes
from .executors import open_executor
from .layout import CacheLayout


@dataclass
class _Page(PageState):
    keys: torch.Tensor | None = None  # exact storage [Hkv, P, dk] while the page is exact
    values: torch.Tensor | None = None  # [Hkv, P, dv]; None when the values live in the keys (MLA)
    recent: RecentPage | None = None


class _Layer(Lifecycle):
    """One layer's cache (batch 1): the lifecycle (runtime/lifecycle.py) over host tensors, with
    Mid pages coded by the exported compressor into the buffers fed to the decode graph."""

    def __init__(self, runner: "HostRunner", index: int):
        super().__init__(runner.config, runner.policy)
        lay = runner.layout
        self.r, self.index = runner, index
        self.shared = bool(lay.shared_value_dim)
        check_value_energy(self.config, self.mid_encoding, self.shared)
        self.scale = lay.scales[index]
        self.seq = SequenceState()
        self.mid_code_bytes = 0  # packed code bytes of keys + values
        self.mid_stats = [0, 0]  # (scale, offset) pairs held (keys, values): per page and direction/channel, or per row
        self.mid_f32 = [False, False]  # a page needed float32 statistics (keys, values)
        self.block_table_len = 0
        # The decode step's Mid and basis inputs at their capacities (float32, or float16 under the
        # "npu" profile); an unprojected Mid has no bases.
        dtypes = {torch.float32: self.r.float_dtype, torch.uint8: np.uint8, torch.int64: np.int64}
        shapes = cache_shapes(lay)
        self.mid = {n: np.zeros(shape, dtypes[dt]) for n, (shape, dt) in shapes.items() if n.startswith("mid_")}
        self.bases = {n: np.zeros(shape, dtypes[dt]) for n, (shape, dt) in shapes.items() if n in BASIS_TENSORS}
        self.mid_len = 0
        self.mid_pages = 0
        self.mid_fed: dict[str, np.ndarray] | None = None  # what the decode step last took of `mid`
        self.buffers = self._cache_buffers()
        self.stale = True  # pages moved since the buffers were last filled
        self.last_page_row = self.recent_rows = 0

    @property
    def pages(self) -> list[_Page]:
        return self.seq.pages

    def append(self, keys: torch.Tensor, values: torch.Tensor | None) -> None:
        n = keys.shape[1]
        if n:
            self.start_append(self.seq, n, keys.shape[-1], (keys, values))
            self.write(self.seq, n, (keys, values))

    def page_kv(self, page: _Page) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A page's keys and values (values None when they live in the keys)."""
        if page.keys is not None:
            values = None if self.shared else page.values[:, : page.tokens].clone()
            return page.keys[:, : page.tokens].clone(), values
        return page.recent.decode()

    # -- accounting (the bytes the session counts, so budgets evict the same tokens) ----------------
    @property
    def exact_page_nbytes(self) -> int:
        lay = self.r.layout
        return lay.kv_heads * lay.page_size * (lay.head_dim + lay.stored_value_dim) * 4

    def page_nbytes(self, page: _Page) -> int:
        if page.keys is not None or page.phase is Phase.TERMINAL:
            return self.exact_page_nbytes
        return page.recent.nbytes if page.recent else 0  # Mid bytes live in the segment

    def mid_nbytes(self, seq: SequenceState) -> int:
        """What the session's `MidSegment.nbytes` holds: codes, per-page statistics (float16, or
        float32 for the whole side once one page needed it), per-page row counts, head bases."""
        seg = seq.mid
        if seg is None:
            return 0
        bases = sum(b.nbytes for b in (seg.key_bases, seg.value_bases) if b is not None)
        stats = sum(2 * count * (4 if f32 else 2) for count, f32 in zip(self.mid_stats, self.mid_f32))
        mid_pages = sum(p.kept is not None for p in seq.pages)
        return bases + self.mid_code_bytes + stats + (1 if self.shared else 2) * 4 * mid_pages

    def sequence_nbytes(self, seq: SequenceState) -> int:
        metadata = 4 * self.block_table_len + (seq.observation.nbytes if seq.observation is not None else 0)
        return sum(self.page_nbytes(p) for p in seq.pages) + self.mid_nbytes(seq) + metadata

    def fp16_token_bytes(self) -> int:
        lay = self.r.layout
        return lay.kv_heads * (lay.head_dim + lay.stored_value_dim) * 2

    def mid_page_nbytes(self, seq: SequenceState, tokens: int) -> int:
        lay = self.r.layout
        return seq.mid.page_nbytes(tokens, lay.kv_heads, lay.head_dim, lay.value_head_dim)

    # -- the lifecycle's hooks ---------------------------------------------------------------------
    def _new_page(self) -> _Page:
        return _Page(Phase.TERMINAL)

    def _page_opened(self, seq: SequenceState, page: _Page) -> None:
        lay = self.r.layout
        page.keys = torch.zeros(lay.kv_heads, lay.page_size, lay.head_dim)
        page.values = None if self.shared else torch.zeros(lay.kv_heads, lay.page_size, lay.value_head_dim)
        self._settled(seq)

    def _write_tokens(self, seq: SequenceState, page: _Page, chunk, start: int, count: int) -> None:
        keys, values = chunk
        sides = [(page.keys, keys, "exact_k")] + ([] if self.shared else [(page.values, values, "exact_v")])
        for stored, new, buffer in sides:
            stored[:, page.tokens: page.tokens + count] = new[:, start: start + count]
            if not self.stale:  # the newest page's rows follow the exact pages before it
                row = self.last_page_row + page.tokens
                self.buffers[buffer][:, row: row + count] = new[:, start: start + count].numpy()

    def _settled(self, seq: SequenceState) -> None:
        self.block_table_len = sum(p.keys is not None for p in seq.pages)
        self.stale = True

    def _new_mid_epoch(self, seq: SequenceState, chunk) -> None:
        new_keys, new_values = chunk
        c = self.config
        key_bases = value_bases = None
        if self.mid_encoding.project:
            held = [self.page_kv(p) for p in seq.pages] + [(new_keys, new_values)]
            key_bases = fit_bases(torch.cat([k for k, _ in held], dim=1), c.key_energy)
            self._set_bases("key", key_bases)
            if not self.shared:
                value_bases = fit_bases(torch.cat([v for _, v in held], dim=1), c.value_energy)
                self._set_bases("value", value_bases)
        seq.mid = MidSegment(self.mid_encoding, key_bases, value_bases, torch.float32,
                             self.r.layout.shared_value_dim)

    def _set_bases(self, side: str, bases: HeadBases) -> None:
        R = self.r.layout.rank_capacity
        if bases.vectors.shape[-1] > R:
            raise ValueError(f"{side} rank {bases.vectors.shape[-1]} exceeds the layout's capacity {R}")
        self.bases[f"{side}_vectors"][:] = 0
        self.bases[f"{side}_vectors"][..., : bases.vectors.shape[-1]] = bases.vectors.numpy()
        self.bases[f"{side}_mean"][:] = bases.mean.numpy()

    def _encode_recent(self, seq: SequenceState, page: _Page) -> None:
        page.recent = encode_recent(*self.page_kv(page), self.recent_bits)

    def _release_exact(self, seq: SequenceState, page: _Page) -> None:
        page.keys = page.values = None

    def _enter_mid(self, seq: SequenceState, index: int) -> int:
        """The exported compressor scores, selects and codes the page's `keep_count` survivors."""
        lay = self.r.layout
        page = seq.pages[index]
        keys, values = self.page_kv(page)
        tokens = page.tokens
        keep = self.keep_count(seq, page)
        page.recent = None
        if keep == 0:
            return 0
        W, f = lay.observation_window, self.r.float_dtype
        obs = np.zeros((lay.heads, W, lay.head_dim), f)
        nq = 0
        if seq.observation is not None:
            nq = seq.observation.shape[1]
            obs[:, :nq] = seq.observation.float().numpy()
        P = lay.page_size
        k = np.zeros((lay.kv_heads, P, lay.head_dim), f)
        k[:, :tokens] = keys.float().numpy()
        feeds = {"keys": k, "queries": obs, "num_queries": np.array(nq, np.int64),
                 "keep": np.array(keep, np.int64), "scale": np.array(self.scale, np.float32), **self.bases}
        if not self.shared:
            feeds["values"] = np.zeros((lay.kv_heads, P, lay.value_head_dim), f)
            feeds["values"][:, :tokens] = values.float().numpy()
        out = self.r.executor.run("compressor", feeds)
        rows, slot = slice(self.mid_len, self.mid_len + keep), self.mid_pages
        if rows.stop > lay.mid_capacity or slot >= lay.mid_page_capacity:
            raise RuntimeError(f"the exported Mid capacity ({lay.mid_capacity} tokens) is full: export with a larger max_context")
        m, per_byte = self.mid, 8 // lay.mid_code_bits
        for index, side in enumerate(("k", "v")[: 1 if self.shared else 2]):
            name = "key" if side == "k" else "value"
            m[f"mid_{side}_codes"][:, rows] = out[f"{name}_codes"][:, :keep]
            scale, offset = out[f"{name}_scale"], out[f"{name}_offset"]
            if lay.mid_projected:  # per page and direction, each head's true rank
                m[f"mid_{side}_scale"][:, slot], m[f"mid_{side}_offset"][:, slot] = scale, offset
                ranks = sum((seq.mid.key_bases if side == "k" else seq.mid.value_bases).ranks)
                self.mid_code_bytes += keep * -(-ranks // per_byte)
                self.mid_stats[index] += ranks
            else:  # KIVI-style: keys per page and channel, values per row
                dim = lay.head_dim if side == "k" else lay.value_head_dim
                if side == "k":
                    m["mid_k_scale"][:, slot], m["mid_k_offset"][:, slot] = scale, offset
                else:
                    m["mid_v_scale"][:, rows], m["mid_v_offset"][:, rows] = scale[:, :keep], offset[:, :keep]
                self.mid_code_bytes += keep * lay.kv_heads * -(-dim // per_byte)
                self.mid_stats[index] += lay.kv_heads * (dim if side == "k" else keep)
        m["mid_row_page"][rows] = slot
        self.mid_len, self.mid_pages = rows.stop, slot + 1
        self.mid_fed = None
        for side, f16 in enumerate(out["stats_f16"]):
            self.mid_f32[side] = self.mid_f32[side] or not bool(f16)
        return keep

    # -- reading ---------------------------------------------------------------------------------------
    def _cache_buffers(self) -> dict[str, np.ndarray]:
        """The decode step's exact and Recent inputs at their fixed capacities. They are filled in
        place (`feeds`), so an executor that binds them once (onnxruntime) copies nothing per step."""
        lay = self.r.layout
        h, C, P = lay.kv_heads, lay.recent_capacity, lay.page_size
        rpb, f = 8 // lay.recent_code_bits, self.r.float_dtype
        buffers = {}
        for side, dim in (("k", lay.head_dim), ("v", lay.value_head_dim))[: 1 if self.shared else 2]:
            # Keys: statistics per Recent page and channel; values: per token.
            stats = (h, C // P, dim) if side == "k" else (h, C)
            buffers.update({f"exact_{side}": np.zeros((h, lay.exact_capacity, dim), f),
                            f"recent_{side}_codes": np.zeros((h, C, -(-dim // rpb)), np.uint8),
                            f"recent_{side}_scale": np.zeros(stats, f), f"recent_{side}_offset": np.zeros(stats, f)})
        return buffers

    def _refill(self) -> None:
        """Rewrite the exact and Recent buffers from the pages (after pages moved: once a page)."""
        P = self.r.layout.page_size
        buffers = self.buffers
        exact = [p for p in self.seq.pages if p.keys is not None]
        recent = [p.recent for p in self.seq.pages if p.recent is not None]
        row = 0
        for page in exact:
            buffers["exact_k"][:, row: row + page.tokens] = page.keys[:, : page.tokens].numpy()
            if not self.shared:
                buffers["exact_v"][:, row: row + page.tokens] = page.values[:, : page.tokens].numpy()
            row += page.tokens
        self.last_page_row = row - (exact[-1].tokens if exact else 0)
        for side in ("k", "v")[: 1 if self.shared else 2]:
            for j, page in enumerate(recent):
                q = page.keys if side == "k" else page.values
                buffers[f"recent_{side}_codes"][:, j * P:(j + 1) * P] = q.codes.numpy()
                scale, offset = buffers[f"recent_{side}_scale"], buffers[f"recent_{side}_offset"]
                if side == "k":
                    scale[:, j], offset[:, j] = q.scale.float()[:, 0].numpy(), q.offset.float()[:, 0].numpy()
                else:
                    scale[:, j * P:(j + 1) * P] = q.scale.float()[..., 0].numpy()
                    offset[:, j * P:(j + 1) * P] = q.offset.float()[..., 0].numpy()
        self.recent_rows = len(recent) * P
        self.stale = False

    def _mid_inputs(self) -> dict[str, np.ndarray]:
        """The Mid buffers as the decode step takes them: at capacity, or (`layout.mid_valid_only`)
        contiguous copies of the rows and pages held (at least 2 of each: the export traced the
        axes as sizes >= 2; the extra rows are masked by the Mid length). Remade only when a page
        enters Mid, so between transitions the same arrays are fed."""
        if self.mid_fed is None:
            self.mid_fed = self.mid
            if self.r.layout.mid_valid_only:
                held = {"rows": max(2, self.mid_len), "pages": max(2, self.mid_pages)}
                self.mid_fed = {name: np.ascontiguousarray(self.mid[name][(slice(None),) * axis + (slice(held[kind]),)])
                                for name, (axis, kind) in mid_axes(self.r.layout).items()}
        return self.mid_fed

    def feeds(self) -> tuple[dict[str, np.ndarray], tuple[int, int, int]]:
        """The decode step's cache inputs of this layer (the same arrays from step to step, updated
        in place or remade when pages move) and its (exact, recent, mid) lengths."""
        if self.stale:
            self._refill()
        exact = self.last_page_row + (self.seq.pages[-1].tokens if self.seq.pages else 0)
        return {**self._mid_inputs(), **self.bases, **self.buffers}, (exact, self.recent_rows, self.mid_len)


class HostRunner:
    """Prefill + decode of an exported model (see the module docstring)."""

    def __init__(self, export_dir, config: Config | None = None, providers=None, threads: int | None = None,
                 runtime: str = "onnxruntime", **runtime_options):
        """`config`: run under another Config than the one exported, when the graphs allow it
        (budget, eviction and prefill settings may differ; what shapes the graphs may not).
        `runtime`: "onnxruntime" (`providers`), "openvino" (`device`) or "iree" (`driver`)."""
        d = Path(export_dir)
        self.layout = CacheLayout.from_json((d / "layout.json").read_text())
        self.float_dtype = np.dtype(self.layout.boundary_dtype)
        exported = self.layout.config_object()
        self.config: Config = exported if config is None else _compatible(config, exported)
        if self.layout.tokens is not None and self.config.prefill_chunk_size != self.layout.tokens:
            raise ValueError(f"the exported decode step takes exactly {self.layout.tokens} token(s) per call, but "
                             f"Config.prefill_chunk_size={self.config.prefill_chunk_size}: run with "
                             f"prefill_chunk_size={self.layout.tokens}")
        self.policy = make_policy(self.config)
        encoding = self.policy.mid_encoding()
        if encoding.refit and self.layout.max_context >= 2 * self.config.refit_after:
            raise ValueError(
                f"the exported graphs hold one set of Mid bases per layer, but Config.refit_after="
                f"{self.config.refit_after} refits them from {2 * self.config.refit_after} tokens on, within this "
                f"export's max_context {self.layout.max_context}: run with refit_after=None (or export a shorter "
                "max_context)")
        if encoding.evict and self.config.eviction_scope != "page":
            raise ValueError(
                f"the exported compressor ranks one page at a time, but Config.eviction_scope="
                f"{self.config.eviction_scope!r} ranks the pages of an append together: run with "
                "eviction_scope='page'")
        if encoding.evict and self.config.prompt_hold_tokens:
            raise ValueError(
                f"the exported decode step reads Recent codes up to a fixed capacity, but Config.prompt_hold_tokens="
                f"{self.config.prompt_hold_tokens} keeps a chunked prompt's pages waiting there for its end: run "
                "with prompt_hold_tokens=0")
        if self.config.max_pages is not None:
            raise ValueError(f"Config.max_pages={self.config.max_pages}: the host runner holds each layer's pages in "
                             "buffers of the export's max_context and sets no page limit; run with max_pages=None "
                             "(export with a smaller max_context to bound memory)")
        if providers is not None:
            runtime_options["providers"] = providers
        self.executor = open_executor(runtime, d, self.layout, threads, **runtime_options)
        self.reset()

    def reset(self) -> None:
        self.layers = [_Layer(self, i) for i in range(self.layout.num_layers)]
        self.position = 0
        self.unfinished: str | None = None  # the error that left a chunk stored in part, until reset()

    def nbytes(self) -> int:
        """Bytes of KV state the session would report (pages + metadata), summed over layers."""
        return sum(layer.sequence_nbytes(layer.seq) for layer in self.layers)

    def forward(self, input_ids: np.ndarray, prompt_end: int = 0) -> np.ndarray:
        """Run one chunk [T] (or [1, T]) of token ids; returns logits [T, V] and stores the chunk.
        `prompt_end`: the length the prompt this chunk belongs to reaches, as `Session.step` takes it."""
        if self.unfinished is not None:
            raise RuntimeError(f"an earlier forward stopped with a chunk stored in part ({self.unfinished}); "
                               "call reset() before running this runner again")
        ids = self._token_ids(input_ids)
        T = ids.shape[1]
        if self.layout.tokens is not None and T != self.layout.tokens:
            raise ValueError(f"the exported decode step takes exactly {self.layout.tokens} token(s) per call, not {T}")
        if self.position + T > self.layout.max_context:
            raise RuntimeError(f"{self.position + T} tokens exceed the export's max_context {self.layout.max_context}: "
                               "export with a larger max_context")
        pos = np.arange(self.position, self.position + T, dtype=np.int64)[None]
        feeds = {"input_ids": ids, "position_ids": pos}
        lengths = np.zeros((self.layout.num_layers, 3), np.int64)
        for i, layer in enumerate(self.layers):
            f, lengths[i] = layer.feeds()
            feeds.update({f"{k}_{i}": v for k, v in f.items()})
        feeds["lengths"] = lengths
        out = self.executor.run("decode_step", feeds)
        try:
            for i, layer in enumerate(self.layers):
                # float16 outputs (the "npu" profile) are held as float32 (exactly), as the lifecycle works.
                layer.observe(layer.seq, torch.from_numpy(out[f"queries_{i}"]).float(), self.layout.kv_heads)
                new_v = out.get(f"new_v_{i}")  # absent when the values live in the keys (MLA)
                layer.seq.prompt_end = prompt_end
                layer.append(torch.from_numpy(out[f"new_k_{i}"]).float(),
                             None if new_v is None else torch.from_numpy(new_v).float())
        except BaseException as error:  # some layers hold the chunk, some not: not to be continued
            self.unfinished = f"{type(error).__name__}: {error}"
            raise
        self.position += T
        return out["logits"][0]

    def _token_ids(self, input_ids) -> np.ndarray:
        """`input_ids` as [1, T] int64: one sequence ([T] or [1, T]) of integer ids in the vocabulary."""
        ids = np.asarray(input_ids)
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"input_ids must be one sequence of at least one token, [T] or [1, T] (the export is "
                             f"batch 1), got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be integer token ids, got {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.layout.vocab_size:
            raise ValueError(f"input_ids hold ids outside the vocabulary [0, {self.layout.vocab_size}): "
                             f"{int(ids.min())}..{int(ids.max())}")
        return ids.astype(np.int64)[None]

    def generate(self, input_ids, max_new_tokens: int, prefill_chunk_size: int | None = None,
                 return_logits: bool = False):
        """Greedy decoding like `kvtopo.generate` (batch 1): -> tokens [prompt + new] (and logits [new, V],
        in the graph's output dtype). A decode step with a fixed token count (the "npu" profile)
        takes the prompt that many tokens per call."""
        if max_new_tokens < 1 or (prefill_chunk_size is not None and prefill_chunk_size < 1):
            raise ValueError(f"max_new_tokens ({max_new_tokens}) and prefill_chunk_size ({prefill_chunk_size}) must be "
                             "at least 1")
        ids = self._token_ids(input_ids)[0]
        chunk = prefill_chunk_size or self.config.prefill_chunk_size
        self.reset()
        for start in range(0, len(ids), chunk):
            logits = self.forward(ids[start:start + chunk], prompt_end=len(ids))[-1]
        tokens, step_logits = [], []
        for step in range(max_new_tokens):
            step_logits.append(logits)
            token = int(np.argmax(logits))
            tokens.append(token)
            if step == max_new_tokens - 1:
                break
            logits = self.forward(np.array([token]))[-1]
        out = np.concatenate([ids, np.array(tokens, np.int64)])
        return (out, np.stack(step_logits)) if return_logits else out


# Config fields the exported graphs or buffer capacities depend on.
_GRAPH_FIELDS = ("policy", "page_size", "sink_tokens", "recent_tokens", "protected_spans", "recent_bits", "mid_bits",
                 "key_energy", "value_energy", "observation_window", "score_margin")


def _compatible(config: Config, exported: Config) -> Config:
    diff = [f for f in _GRAPH_FIELDS if getattr(config, f) != getattr(exported, f)
            and not (f in ("key_energy", "value_energy") and getattr(config, f) and getattr(exported, f))]
    if diff:
        raise ValueError(f"config differs from the exported one in {diff}, which the graphs depend on: re-export")
    return config
