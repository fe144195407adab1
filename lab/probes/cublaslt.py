"""cuBLASLt's FP8 GEMM through ctypes, with the algorithm chosen by the caller (for lab/probes/cublaslt_algo_probe.py).

`torch._scaled_mm` always runs the first algorithm cuBLASLt's heuristic ranks for a shape (at the 57b shard's
block shapes it offers just one), and the heuristic ranks by time with the clock up. In the served step the GPU
sits at its power limit, where a kernel costs the step its energy, so the probe enumerates every configuration
cuBLASLt accepts and holds each at the power limit. The product is the one FP8Linear computes,
out (M, N) bf16 = (x8 (M, K) @ w8 (N, K)ᵀ) * sx (M, 1) * sw (1, N), with per-row and per-column scales
(cuBLASLt's outer-vector scaling, cuBLAS >= 12.9) and optionally fast accumulation.

In cuBLASLt's column-major terms: D (N x M, ld N) = op(A) op(B) with A = w8 (K x N, ld K, transposed)
and B = x8 (K x M, ld K), the A scale a vector over N and the B scale one over M. No workspace, as the
engine runs cuBLASLt (engine/kernels/fp8_linear.py): the calls capture into CUDA graphs and need no memset.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import itertools
import os
from dataclasses import dataclass

import torch

# cublasLt.h / library_types.h / cublas_api.h
_CUDA_R_32F, _CUDA_R_16BF, _CUDA_R_8F_E4M3 = 0, 14, 28
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_OUTER_VEC_32F = 3
_PREF_MAX_WORKSPACE_BYTES = 1
_CAP_TILE_IDS, _CAP_CUSTOM_OPTION_MAX, _CAP_STAGES_IDS = 6, 7, 13
# cublasLtMatmulTile_t: 64x256, 128x128, 256x64, 128x256, 256x128, 128x160, 160x128, 192x128, 128x192
LARGE_TILES = (19, 20, 21, 23, 24, 29, 30, 31, 32)
CLUSTERS = (2, 3, 5, 6)  # cublasLtClusterShape_t: 1x1, 2x1, 1x2, 2x2
# algorithm configuration attributes and their value types
_CONFIG = {"id": (0, ctypes.c_int32), "tile": (1, ctypes.c_uint32), "splitk": (2, ctypes.c_uint32),
           "reduction": (3, ctypes.c_uint32), "swizzle": (4, ctypes.c_uint32), "custom": (5, ctypes.c_uint32),
           "stages": (6, ctypes.c_uint32), "inner_shape": (7, ctypes.c_uint16), "cluster_shape": (8, ctypes.c_uint16)}


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


@functools.cache
def library() -> ctypes.CDLL:
    """The libcublasLt torch loaded (its soname first, then torch's own nvidia/*/lib directories)."""
    names = ["libcublasLt.so.13", "libcublasLt.so.12"]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcublasLt.so.*")))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        _declare(lib)
        return lib
    raise CublasLtError("libcublasLt not found (looked for " + ", ".join(names) + ")")


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types, so that size_t and 64-bit arguments cross as such."""
    vp, i32, sz, p = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.POINTER
    sigs = {
        "cublasLtCreate": [p(vp)],
        "cublasLtMatmulDescCreate": [p(vp), i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [p(vp), i32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        "cublasLtMatmulPreferenceCreate": [p(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatrixLayoutDestroy": [vp],
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, p(_HeuristicResult), p(i32)],
        "cublasLtMatmulAlgoConfigGetAttribute": [p(_Algo), i32, vp, sz, p(sz)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, p(_Algo), vp, sz, vp],
        "cublasLtMatmulAlgoGetIds": [vp, i32, i32, i32, i32, i32, i32, i32, p(i32), p(i32)],
        "cublasLtMatmulAlgoInit": [vp, i32, i32, i32, i32, i32, i32, i32, p(_Algo)],
        "cublasLtMatmulAlgoCapGetAttribute": [p(_Algo), i32, vp, sz, p(sz)],
        "cublasLtMatmulAlgoConfigSetAttribute": [p(_Algo), i32, vp, sz],
        "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, p(_Algo), p(_HeuristicResult)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], ctypes.c_size_t


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cublasStatus {status}")


@functools.cache
def _handle() -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    _check(library().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h


def version() -> int:
    return int(library().cublasLtGetVersion())


@dataclass
class Algorithm:
    """A configuration to run: its rank among the heuristic's candidates (0 = what torch._scaled_mm runs; -1 for one
    `ScaledMatmul.enumerate` found), its configuration attributes and the waves cuBLASLt expects it to fill."""
    rank: int
    config: dict[str, int]
    waves: float
    workspace_bytes: int
    raw: _Algo


class ScaledMatmul:
    """out (M, N) bf16 = (x8 @ w8ᵀ) * sx * sw for one shape (M, K, N), e4m3 in, per-row x per-column scales."""

    def __init__(self, M: int, K: int, N: int, fast_accum: bool = True):
        self.shape = (M, K, N)
        self.fast_accum = fast_accum
        lib = library()
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _CUDA_R_32F), "cublasLtMatmulDescCreate")
        for attr, value, ctype in ((_DESC_TRANSA, _OP_T, ctypes.c_int32), (_DESC_TRANSB, _OP_N, ctypes.c_int32),
                                   (_DESC_A_SCALE_MODE, _SCALE_OUTER_VEC_32F, ctypes.c_int32),
                                   (_DESC_B_SCALE_MODE, _SCALE_OUTER_VEC_32F, ctypes.c_int32),
                                   (_DESC_FAST_ACCUM, int(fast_accum), ctypes.c_int8)):
            self._set(attr, ctype(value))
        self._a = self._layout(_CUDA_R_8F_E4M3, K, N, K)   # w8 (N, K) row-major
        self._b = self._layout(_CUDA_R_8F_E4M3, K, M, K)   # x8 (M, K) row-major
        self._d = self._layout(_CUDA_R_16BF, N, M, N)      # out (M, N) row-major
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def __del__(self) -> None:
        """Release the descriptor and layouts (a probe makes one of these per shape)."""
        lib = library()
        for lay in (getattr(self, name, None) for name in ("_a", "_b", "_d")):
            if lay:
                lib.cublasLtMatrixLayoutDestroy(lay)
        if getattr(self, "_desc", None):
            lib.cublasLtMatmulDescDestroy(self._desc)

    def _set(self, attr: int, value: ctypes._SimpleCData) -> None:
        _check(library().cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
               f"cublasLtMatmulDescSetAttribute({attr})")

    @staticmethod
    def _layout(dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        lay = ctypes.c_void_p()
        _check(library().cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                                    ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
        return lay

    def bind_scales(self, sx: torch.Tensor, sw: torch.Tensor) -> None:
        """The scale vectors' addresses (cuBLASLt's heuristic and checks refuse outer-vector scaling without them)."""
        self._set(_DESC_A_SCALE_POINTER, ctypes.c_void_p(sw.data_ptr()))
        self._set(_DESC_B_SCALE_POINTER, ctypes.c_void_p(sx.data_ptr()))

    def algorithms(self, count: int = 16, workspace_bytes: int = 0) -> list[Algorithm]:
        """The heuristic's candidates, best first by its own ranking (after `bind_scales`)."""
        lib = library()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(workspace_bytes)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                            ctypes.sizeof(ws)), "cublasLtMatmulPreferenceSetAttribute")
            results = (_HeuristicResult * count)()
            returned = ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(), self._desc, self._a, self._b, self._d, self._d, pref, count,
                                                      results, ctypes.byref(returned)), "cublasLtMatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [Algorithm(rank, _config(r.algo), float(r.waves), int(r.workspace_size), r.algo)
                for rank, r in enumerate(results[:returned.value]) if r.state == 0]

    def enumerate(self, tiles: tuple[int, ...] = LARGE_TILES, clusters: tuple[int, ...] = CLUSTERS) -> list[Algorithm]:
        """Every configuration cuBLASLt accepts for this problem without a workspace, over its algorithms' tiles (of
        `tiles`), stages, custom options and `clusters` (after `bind_scales`); rank -1, waves from the check."""
        lib, h = library(), _handle()
        types = (_COMPUTE_32F, _CUDA_R_32F, _CUDA_R_8F_E4M3, _CUDA_R_8F_E4M3, _CUDA_R_16BF, _CUDA_R_16BF)
        ids, n = (ctypes.c_int * 256)(), ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetIds(h, *types, 256, ids, ctypes.byref(n)), "cublasLtMatmulAlgoGetIds")
        found: list[Algorithm] = []
        for algo_id in ids[:n.value]:
            base = _Algo()
            if lib.cublasLtMatmulAlgoInit(h, *types, algo_id, ctypes.byref(base)) != 0:
                continue
            algo_tiles = [t for t in _cap_array(base, _CAP_TILE_IDS, ctypes.c_uint32) if t in tiles]
            stage_ids = _cap_array(base, _CAP_STAGES_IDS, ctypes.c_uint32) or [0]
            custom_max = _cap_array(base, _CAP_CUSTOM_OPTION_MAX, ctypes.c_int32)
            customs = range((custom_max[0] if custom_max else 0) + 1)
            for tile, stages, cluster, custom in itertools.product(algo_tiles, stage_ids, clusters, customs):
                algo = _Algo.from_buffer_copy(base)
                for name, value in (("tile", tile), ("stages", stages), ("cluster_shape", cluster), ("custom", custom)):
                    attr, ctype = _CONFIG[name]
                    v = ctype(value)
                    lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), ctypes.sizeof(v))
                result = _HeuristicResult()
                if (lib.cublasLtMatmulAlgoCheck(h, self._desc, self._a, self._b, self._d, self._d, ctypes.byref(algo),
                                                ctypes.byref(result)) == 0 and result.workspace_size == 0):
                    found.append(Algorithm(-1, _config(algo), float(result.waves), 0, algo))
        return found

    def __call__(self, x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, algo: Algorithm,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """out = (x8 @ w8ᵀ) * sx * sw on the current stream, with `algo`."""
        M, K, N = self.shape
        if x8.shape != (M, K) or w8.shape != (N, K) or not (x8.is_contiguous() and w8.is_contiguous()):
            raise ValueError(f"ScaledMatmul{self.shape} takes contiguous x8 ({M}, {K}) and w8 ({N}, {K}), "
                             f"got {tuple(x8.shape)} and {tuple(w8.shape)}")
        for name, v, n in (("sx", sx, M), ("sw", sw, N)):
            if v.numel() != n or v.dtype != torch.float32 or v.reshape(-1).stride(0) != 1 or v.data_ptr() % 16:
                raise ValueError(f"{name} must be {n} contiguous float32 values at a 16-byte aligned address, "
                                 f"got {tuple(v.shape)} {v.dtype} at offset {v.data_ptr() % 16}")
        if out is not None and (out.shape != (M, N) or out.dtype != torch.bfloat16 or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous bf16 ({M}, {N}), got {tuple(out.shape)} {out.dtype}")
        if algo.workspace_bytes:
            raise ValueError("algorithms that need a workspace are not run here")
        out = torch.empty(M, N, device=x8.device, dtype=torch.bfloat16) if out is None else out
        self.bind_scales(sx, sw)
        stream = ctypes.c_void_p(torch.cuda.current_stream(x8.device).cuda_stream)
        _check(library().cublasLtMatmul(_handle(), self._desc, ctypes.byref(self._alpha), ctypes.c_void_p(w8.data_ptr()),
                                        self._a, ctypes.c_void_p(x8.data_ptr()), self._b, ctypes.byref(self._beta),
                                        ctypes.c_void_p(out.data_ptr()), self._d, ctypes.c_void_p(out.data_ptr()), self._d,
                                        ctypes.byref(algo.raw), None, ctypes.c_size_t(0), stream), "cublasLtMatmul")
        return out


def _cap_array(algo: _Algo, attr: int, ctype: type) -> list[int]:
    written = ctypes.c_size_t(0)
    if library().cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(written)) != 0:
        return []
    n = max(written.value // ctypes.sizeof(ctype), 1)
    buf = (ctype * n)()
    if library().cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf, ctypes.sizeof(buf), ctypes.byref(written)) != 0:
        return []
    return [int(v) for v in buf[:written.value // ctypes.sizeof(ctype)]]


def _config(algo: _Algo) -> dict[str, int]:
    out = {}
    for name, (attr, ctype) in _CONFIG.items():
        v, written = ctype(0), ctypes.c_size_t(0)
        if library().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), ctypes.sizeof(v),
                                                          ctypes.byref(written)) == 0:
            out[name] = int(v.value)
    return out
