"""pagedllm's C++ kernels for CPU, built with torch's extension tools (torch.utils.cpp_extension).

`make setup` builds them once (`python -m pagedllm.kernels`); otherwise the first use builds
them (a C++ compiler and ninja are needed, about a minute). The build is cached per source,
torch version and CPU (it is compiled with -march=native) under ~/.cache/pagedllm/kernels, or
$PAGEDLLM_KERNEL_CACHE.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.cpu_info import cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in ("module.cpp", "paged_attention.cpp", "kv_cache.cpp", "norm_rotary.cpp",
                 "quant_linear.cpp", "quant_int4_bf16.cpp", "dense_linear.cpp", "decoder.cpp",
                 "lora.cpp", "int8_act_linear.cpp", "int8_act_avx512_vnni.cpp",
                 "int8_act_avx2.cpp", "mamba_state.cpp")
]  # fmt: skip
HEADERS = [
    CSRC / name
    for name in ("ops.h", "kv_format.h", "linear_tiles.h", "int8_act.h", "quant_blocks.h",
                 "attention_chunk.h")
]  # fmt: skip


def _capability_flags() -> list[str]:
    """ATen's at::vec width for this CPU (its CPU_CAPABILITY macros), like ATen's own builds."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


# -ffp-contract=off: no fused multiply-adds the torch code they mirror does not have.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", *_capability_flags()]


class KernelUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded on this machine."""


def build_key() -> str:
    """Changes with the sources, torch, Python, the CPU's flags (-march=native) and CFLAGS."""
    h = hashlib.sha256()
    for p in SOURCES + HEADERS:
        h.update(p.read_bytes())
    for part in (torch.__version__, sys.version, " ".join(sorted(cpu_flags())), *CFLAGS):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build_directory() -> Path:
    root = (
        os.environ.get("PAGEDLLM_KERNEL_CACHE") or Path.home() / ".cache" / "pagedllm" / "kernels"
    )
    return Path(root) / build_key()


@functools.cache
def cpu_ops() -> ModuleType:
    """The compiled module (paged_attention); raises KernelUnavailable with the reason."""
    name = "pagedllm_cpu_ops"
    directory = build_directory()
    library = directory / f"{name}.so"
    if not library.exists():
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        logger.info("building the C++ CPU kernels in %s (once per machine)", directory)
        try:
            cpp_extension.load(
                name,
                [str(p) for p in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a build error
            raise KernelUnavailable(f"building the C++ CPU kernels failed: {e}") from e
    # Import by path: the cached library, whatever process built it.
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None:
        raise KernelUnavailable(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise KernelUnavailable(f"loading {library} failed: {e}") from e
    return module


@functools.cache
def available() -> bool:
    """Whether the kernels build and load here (a warning says why not, once)."""
    try:
        cpu_ops()
    except KernelUnavailable as e:
        logger.warning("%s; falling back to the SDPA attention backend", e)
        return False
    return True


def fused_cpu_ops_apply(x: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels (RMSNorm, rotary) take `x`: a CPU tensor, outside
    autograd, on a machine where the kernels build."""
    return (
        x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad) and available()
    )


def fixed_order(x: torch.Tensor) -> bool:
    """Whether products with `x` can go through the kernels' fixed-order paths, whose result
    for a row does not depend on the other rows of the step (docs/determinism.md): float32 or
    bfloat16 CPU tensors outside autograd, where the kernels build."""
    return x.dtype in (torch.float32, torch.bfloat16) and fused_cpu_ops_apply(x)


def in_float32(product, x: torch.Tensor) -> torch.Tensor:
    """`product` (float32 -> float32) of `x`, in x's dtype: a bfloat16 x is widened (exactly)
    and the float32 result rounded once, so the order of the sums is the float32 kernel's."""
    if x.dtype == torch.float32:
        return product(x)
    return product(x.float()).to(x.dtype)
