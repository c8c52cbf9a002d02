"""Machine identity: the CPU, its kernel extensions, ONNX Runtime and threads (one reader of /proc/cpuinfo)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_fields(cpuinfo: Path = CPUINFO) -> dict[str, str]:
    """The first core's `key: value` fields of `/proc/cpuinfo` (empty where there is none, e.g. macOS)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_name() -> str:
    """The CPU model, from /proc/cpuinfo where there is one."""
    return cpuinfo_fields().get("model name") or platform.processor() or "unknown"


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """This CPU's feature flags (x86 `flags`, Arm `Features`; empty where there is no cpuinfo)."""
    fields = cpuinfo_fields(cpuinfo)
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


# Instruction-set extensions that change which kernels ONNX Runtime and torch run (and so what a
# width costs); one CPU name can cover two generations (docs/explanation/int8.md#machine).
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "i8mm",
    "sve",
)


def cpu_features(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's family/model numbers and kernel-relevant extensions from `cpuinfo` ("" without one).

    E.g. `family 25 model 17: avx2 fma avx512f avx512bw avx512_vnni avx512_bf16`; on Arm the
    first core's `Features` (`asimd asimddp i8mm`).
    """
    fields = cpuinfo_fields(cpuinfo)
    flags = cpu_flags(cpuinfo)
    ident = " ".join(f"{k.removeprefix('cpu ')} {fields[k]}" for k in ("cpu family", "model") if k in fields)
    present = " ".join(f for f in KERNEL_FLAGS if f in flags)
    return f"{ident}: {present}" if ident else present


def cuda_device() -> str | None:
    """The name of the CUDA device torch sees here, or None (nothing in the pipeline times one)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def gpu_not_timed(gpu: str) -> str:
    """The warning where the machine has a GPU: every latency of the pipeline is ONNX Runtime on its CPU."""
    return (
        f"a CUDA device is here ({gpu}), but nothing in this pipeline ran on it: the latency table, the prune gate, "
        "quantize's choice and these figures are ONNX Runtime on the CPU, and the served model runs there too; "
        "widths fast on this CPU can run slower than dense on a GPU (on an H100 a 14-channel block did: "
        "docs/results/gpu/report.md), so time the model on the GPU before serving it there"
    )


def machine_info(threads: int, *runtimes: str) -> dict[str, Any]:
    """What the figures were measured on: the CPU, the threads, the runtimes' versions (default: onnxruntime's)."""
    from pruneops.runtimes import get_runtime

    versions = {k: v for name in runtimes or ("onnxruntime",) for k, v in get_runtime(name).versions().items()}
    return {
        "cpu": cpu_name(),
        "cpu_features": cpu_features(),
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        **versions,
        "date": time.strftime("%Y-%m-%d"),
    }


def machine_fingerprint(threads: int) -> dict[str, Any]:
    """What a latency measurement depends on besides the model: `machine_info` less the date and Python."""
    info = machine_info(threads)  # its cpu_features: a VM may give two CPU generations one name
    kept = ("cpu", "cpu_features", "cores", "onnxruntime", "threads")
    return {**{k: info[k] for k in kept}, "machine": platform.machine()}
