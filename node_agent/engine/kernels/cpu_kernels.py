"""The compiled CPU kernels of a decode step (`cpu_kernels.c`), built at first use: a few rows
times a weight (`gemm`), and the LoRA delta of a few rows, each with its own slot (`add_lora_rows`).

Why kernels of our own: a CPU decode step multiplies one row per running sequence by every
weight, so its time is the weight's stream from memory. MKL's matrix-vector product streams a
weight at that speed for one row; for several rows neither MKL (which packs the weight on
every call) nor oneDNN (which runs the arithmetic after the stream instead of under it) does,
so a step of 8 sequences costs well over a step of one (docs/kernels.md, "The CPU path"). `gemm`
runs 1 to 8 rows in about the time of one, over an fp32, bf16 or fp16 weight (fp32 rows and
result either way: a 16-bit weight widens exactly, so only the bytes streamed halve). The LoRA delta of 8 rows over 8 adapters in torch
is about 350 small ops a step (a matrix-vector product per row and slice); `add_lora_rows` is
one call per layer, which reads each row's A and B once.

Built like triton's launchers: the system's C compiler (`$CC`, else `cc`, `gcc` or `clang`)
compiles the source once per machine into the project's cache directory (`$LORAFLEET_CACHE`,
else `~/.cache/lorafleet`, as the development scripts use), keyed by the source and flags. Without
a compiler, or on a CPU without AVX-512F, `library()` is None and the engine keeps oneDNN, MKL
and torch; `LORAFLEET_KERNELS=torch` keeps them too (`dispatch.compiled_cpu`). The agent image
carries gcc (for triton's launchers), so a CPU agent in a pod builds them at first use.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAX_ROWS = 8  # the most rows `gemm` takes (registers hold 2 x 8 accumulators of 16 columns); `add_lora_rows` serves as many
MAX_TOTAL_RANK = 4096  # of one layer's slices together, for `add_lora_rows` (its shrink lives on the stack)
BLOCK = 32  # output columns per packed block
_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_FLAGS = ("-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC")
_COMPILE_TIMEOUT_S = 120


class KernelUnavailable(RuntimeError):
    """Why the compiled kernel cannot serve on this machine."""


def cache_dir() -> Path:
    """Where built kernels are kept (see the module's docstring)."""
    explicit = os.environ.get("LORAFLEET_CACHE")
    return Path(explicit) if explicit else Path.home() / ".cache" / "lorafleet"


@cache
def library() -> ctypes.CDLL | None:
    """The built kernels, loaded once per process; None where they cannot serve (logged once)."""
    try:
        lib = _load(_build())
    except KernelUnavailable as error:
        log.info("the compiled CPU kernels are unavailable (%s); oneDNN, MKL and torch serve", error)
        return None
    return lib


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [n, k] as the kernel reads it: [ceil(n / 32), k, 32], zero columns past n."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the weights `gemm` reads


def gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x · weightᵀ + bias` in fp32 for 1 to MAX_ROWS fp32 rows of `x` [rows, k], `packed` =
    `pack(weight)` of an fp32, bf16 or fp16 weight (any `bias` dtype: it is read in fp32)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    # The C code trusts its sizes and types: a mismatch here would read past a buffer, so it is an error.
    if (
        x.dtype != torch.float32
        or packed.dtype not in PACKED_DTYPES
        or packed.dim() != 3
        or packed.shape[1:] != (k, BLOCK)
        or packed.shape[0] * BLOCK < n
        or (bias is not None and bias.numel() < n)
    ):
        raise ValueError(
            f"x [{rows}, {k}] {x.dtype} and bias do not fit a packed weight {list(packed.shape)} {packed.dtype} of {n} columns"
        )
    out = torch.empty(rows, n, dtype=torch.float32)
    bias = None if bias is None else bias.float().contiguous()  # held here while the kernel reads it
    entry = {torch.float32: lib.lf_gemm, torch.bfloat16: lib.lf_gemm_bf16, torch.float16: lib.lf_gemm_f16}[packed.dtype]
    status = entry(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        rows,
        n,
        k,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"the compiled CPU kernel takes 1 to {MAX_ROWS} rows, not {rows}")
    return out


@dataclass(frozen=True)
class LoraBuffers:
    """A layer's LoRA buffers in the form `add_lora_rows` reads, checked once (`lora_buffers`):
    their pointers stay valid because slots are written in place."""

    a_joined: torch.Tensor  # [slots, Σ ranks, in]: every slice's A as its row block
    b_stacks: tuple[torch.Tensor, ...]  # [slots, width, rank] each: each slot's B column-major
    scales: torch.Tensor  # [slices, slots]
    b_pointers: ctypes.Array[ctypes.c_void_p]
    widths: ctypes.Array[ctypes.c_int64]
    ranks: ctypes.Array[ctypes.c_int64]
    total_width: int  # Σ widths: the columns of the layer's output


def lora_buffers(a_joined: torch.Tensor, b_stacks: Sequence[torch.Tensor], scales: torch.Tensor) -> LoraBuffers | None:
    """The layer's buffers for `add_lora_rows`; None where they are not in its form (A and B not
    of one of `PACKED_DTYPES` on the CPU, scales not fp32, a B stack row-major, ranks unlike A's
    row blocks, a total rank over MAX_TOTAL_RANK)."""
    ranks = [b.shape[2] for b in b_stacks]
    if (
        a_joined.dtype not in PACKED_DTYPES
        or scales.dtype != torch.float32
        or any(t.dtype != a_joined.dtype for t in b_stacks)
        or any(t.device.type != "cpu" for t in (a_joined, scales, *b_stacks))
        or not a_joined.is_contiguous()
        or not scales.is_contiguous()
        or sum(ranks) != a_joined.shape[1]
        or a_joined.shape[1] > MAX_TOTAL_RANK
        or any(b.stride() != (b.shape[1] * b.shape[2], 1, b.shape[1]) for b in b_stacks)
    ):
        return None
    count, widths = len(b_stacks), [b.shape[1] for b in b_stacks]
    return LoraBuffers(
        a_joined,
        tuple(b_stacks),
        scales,
        (ctypes.c_void_p * count)(*(b.data_ptr() for b in b_stacks)),
        (ctypes.c_int64 * count)(*widths),
        (ctypes.c_int64 * count)(*ranks),
        sum(widths),
    )


def add_lora_rows(lib: ctypes.CDLL, x: torch.Tensor, out: torch.Tensor, buffers: LoraBuffers, token_slots: torch.Tensor) -> bool:
    """Add the LoRA delta of each row of `x` [rows, in] into `out` [rows, Σ widths]: row t with
    slot s = `token_slots[t]` (−1: none) gets Σ_i `scales[i, s]` · B_i[s] · (A_i[s] · x[t]) in
    slice i's columns, in fp32 whatever the buffers' dtype. Returns False, having done nothing,
    for `x` or `out` in another form (not fp32 on the CPU with unit column stride) or of other
    sizes than the buffers'.
    """
    rows = x.shape[0]
    if (
        x.dtype != torch.float32
        or out.dtype != torch.float32
        or x.device.type != "cpu"
        or out.device.type != "cpu"
        or x.stride(1) != 1
        or out.stride(1) != 1
        or x.shape[1] != buffers.a_joined.shape[2]
        or out.shape != (rows, buffers.total_width)
        or token_slots.shape != (rows,)
    ):
        return False
    slots = token_slots if token_slots.dtype == torch.int32 and token_slots.is_contiguous() else (token_slots.to(torch.int32).contiguous())
    a = buffers.a_joined
    entry = {torch.float32: lib.lf_lora_rows, torch.bfloat16: lib.lf_lora_rows_bf16, torch.float16: lib.lf_lora_rows_f16}[a.dtype]
    status = entry(
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        out.stride(0),
        rows,
        slots.data_ptr(),
        a.data_ptr(),
        a.shape[1],
        a.shape[2],
        len(buffers.b_stacks),
        buffers.b_pointers,
        buffers.widths,
        buffers.ranks,
        buffers.scales.data_ptr(),
        buffers.scales.shape[1],
        torch.get_num_threads(),
    )
    return bool(status == 0)


def _load(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelUnavailable(f"cannot load {path}: {error}") from error
    if not lib.lf_supported():
        raise KernelUnavailable("this CPU has no AVX-512F")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for entry in (lib.lf_gemm, lib.lf_gemm_bf16, lib.lf_gemm_f16):
        entry.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_int]
        entry.restype = ctypes.c_int
    for entry in (lib.lf_lora_rows, lib.lf_lora_rows_bf16, lib.lf_lora_rows_f16):
        entry.argtypes = [p, i64, p, i64, i64, p, p, i64, i64, i64, p, p, p, p, i64, ctypes.c_int]
        entry.restype = ctypes.c_int
    return lib


def _build() -> Path:
    """The built library's path, compiling it first if no process has on this machine."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelUnavailable(f"the kernel is for x86-64, not {platform.machine()}")
    compiler = _compiler()
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), *(flag.encode() for flag in _FLAGS)])).hexdigest()
    target = cache_dir() / f"cpu_kernels-{key[:16]}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Ranks start together: one compiles, the others wait for its file.
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                _compile(compiler, target)
    except OSError as error:
        raise KernelUnavailable(f"cannot write {target.parent}: {error}") from error
    return target


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    raise KernelUnavailable("no C compiler ($CC, cc, gcc or clang) on PATH")


def _compile(compiler: str, target: Path) -> None:
    fd, scratch = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", scratch], capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise KernelUnavailable(f"{Path(compiler).name} failed on {_SOURCE.name}: {last}")
        os.replace(scratch, target)
        log.info("built the compiled CPU kernels: %s", target)
    except subprocess.TimeoutExpired as error:
        raise KernelUnavailable(f"{Path(compiler).name} took over {_COMPILE_TIMEOUT_S} s") from error
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
