"""Deployment CPUs: which integer arithmetic a file meets there, and this machine's facts.

ONNX Runtime's u8 x s8 kernels on x86 without VNNI (AVX2, AVX-512BW) multiply with vpmaddubsw: two
adjacent products add into a saturating int16 (core.int_kernels.Accumulation.PAIRWISE_INT16). VNNI,
AMX and ARM64 kernels accumulate in int32 (EXACT). Which one runs is the engine's choice, so this
machine's family is found by a behavioural probe, not from the CPU flags alone.
"""

from __future__ import annotations

import enum
import functools
import os
import platform as _platform
from dataclasses import dataclass, field
from typing import TypeVar

from netquant.core.int_kernels import INT16_MAX, Accumulation
from netquant.errors import ConfigError

INT8_FLAGS = ("avx2", "avx512bw", "avx512_vnni", "avx_vnni", "avx_vnni_int8", "amx_int8",  # x86
              "asimddp", "i8mm", "sve", "sve2")  # ARM64: dot product, int8 matrix multiply


class CpuTarget(enum.StrEnum):
    """The CPUs an exported file will run on."""

    ANY = "any"  # every x86-64 and ARM64 CPU: must not saturate anywhere
    X86_NO_VNNI = "x86-no-vnni"  # AVX2 / AVX-512 without VNNI: int16 pair saturation
    X86_VNNI = "x86-vnni"  # AVX512-VNNI, AVX-VNNI or AMX: exact int32
    ARM64 = "arm64"  # NEON sdot/udot, i8mm: exact int32
    HOST = "host"  # this machine, as probed

    @classmethod
    def parse(cls, value: CpuTarget | str) -> CpuTarget:
        return _parse(cls, value, "CPU target")


class WeightScheme(enum.StrEnum):
    """How int8-kernel weights are stored (see benchmarks/results/weight_schemes.md for the measured choice)."""

    INT8 = "int8"  # full-range int8: exact only on VNNI / ARM kernels
    INT7 = "int7"  # symmetric int8 codes in [-64, 64] (onnxruntime's reduce_range): never saturates
    UINT8 = "uint8"  # uint8 weights around zero point 128 (U8U8 kernels): exact, 8 bits
    INT8_PAIR_LIMITED = "int8-pairs"  # int8, but |q0| + |q1| <= 128 in each same-sign pair the kernel adds

    @classmethod
    def parse(cls, value: WeightScheme | str) -> WeightScheme:
        return _parse(cls, value, "weight scheme")

    @property
    def saturation_free(self) -> bool:
        return self is not WeightScheme.INT8


E = TypeVar("E", bound=enum.StrEnum)


def _parse(cls: type[E], value: E | str, what: str) -> E:
    """An enum member from itself or its value ('_' and '-' alike, any case); ConfigError listing the choices."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).strip().lower().replace("_", "-"))
    except ValueError:
        raise ConfigError(f"unknown {what} '{value}'; choose one of {', '.join(m.value for m in cls)}") from None


def accumulations_of(target: CpuTarget) -> frozenset[Accumulation]:
    """The integer arithmetic a file for `target` may meet."""
    if target is CpuTarget.ANY:
        return frozenset(Accumulation)
    if target is CpuTarget.X86_NO_VNNI:
        return frozenset({Accumulation.PAIRWISE_INT16})
    if target is CpuTarget.HOST:
        return frozenset({host_accumulation()})
    return frozenset({Accumulation.EXACT})


def needs_saturation_free_weights(target: CpuTarget) -> bool:
    return Accumulation.PAIRWISE_INT16 in accumulations_of(target)


# ---- this machine ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuInfo:
    """The CPU model, architecture and its int8-relevant flags."""

    model: str
    arch: str
    flags: tuple[str, ...]
    logical_cores: int

    @property
    def has_vnni(self) -> bool:
        return any(f in self.flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))

    def describe(self) -> str:
        flags = " ".join(self.flags) or "none"
        return f"{self.model} ({self.arch}, {self.logical_cores} logical cores; int8 flags: {flags})"


@functools.cache
def cpu_info() -> CpuInfo:
    """CPU model and int8 flags from /proc/cpuinfo (Linux), else what `platform` knows."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model", "hardware") and not model:
                    model = value.strip()
                elif key in ("flags", "features"):
                    flags.update(value.split())
    except OSError:
        pass
    arch = _platform.machine() or "unknown"
    return CpuInfo(model=model or _platform.processor() or arch, arch=arch,
                   flags=tuple(f for f in INT8_FLAGS if f in flags), logical_cores=os.cpu_count() or 1)


@functools.cache
def host_accumulation() -> Accumulation:
    """How this machine's onnxruntime sums u8 x s8 products, found by running one MatMulInteger.

    a = [255, 255], b = [127, 127]: exact int32 gives 64770, a saturating int16 pair gives 32767.
    """
    import numpy as np

    got = int(_run_probe(np.full((1, 2), 255, np.uint8), np.full((2, 1), 127, np.int8))[0, 0])
    if got == 2 * 255 * 127:
        return Accumulation.EXACT
    if got == INT16_MAX:
        return Accumulation.PAIRWISE_INT16
    raise ConfigError(f"onnxruntime's MatMulInteger probe returned {got} (expected 64770 for int32 or 32767 for "
                      "saturating int16 accumulation): please report this CPU / onnxruntime pair "
                      "(`netquant doctor`) and pass an explicit target=")


def _run_probe(a: object, b: object) -> object:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "netquant_int8_probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [None, None])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)], [numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"a": a})[0]


def kernel_family(acc: Accumulation, cpu: CpuInfo | None = None) -> str:
    """A reader's name for the int8 kernel family."""
    cpu = cpu or cpu_info()
    if acc is Accumulation.PAIRWISE_INT16:
        return "x86 without VNNI: u8 x s8 pairs add in saturating int16 (vpmaddubsw)"
    if cpu.arch in ("aarch64", "arm64"):
        return "ARM64: exact int32 accumulation (sdot/udot or widening multiplies)"
    return "exact int32 accumulation (VNNI / AMX)"


@dataclass(frozen=True)
class HostInfo:
    """What a bug report or a benchmark table needs to say about where it ran."""

    cpu: CpuInfo
    accumulation: Accumulation
    versions: dict[str, str] = field(default_factory=dict)
    threads: dict[str, str] = field(default_factory=dict)

    @property
    def target(self) -> CpuTarget:
        """The CpuTarget this machine is."""
        if self.accumulation is Accumulation.PAIRWISE_INT16:
            return CpuTarget.X86_NO_VNNI
        return CpuTarget.ARM64 if self.cpu.arch in ("aarch64", "arm64") else CpuTarget.X86_VNNI

    def lines(self) -> list[tuple[str, str]]:
        rows = [("CPU", self.cpu.describe()),
                ("int8 kernel family (onnxruntime probe)",
                 f"{self.accumulation.value}: {kernel_family(self.accumulation, self.cpu)}"),
                ("CPU target of this machine", self.target.value)]
        rows += [(name, v) for name, v in self.versions.items()]
        rows += [(name, v) for name, v in self.threads.items()]
        return rows

    def markdown(self) -> str:
        """A few lines for benchmarks/results/*.md."""
        return "\n".join(f"- {k}: {v}" for k, v in self.lines()) + "\n"


def host_info(torch_threads: int | None = None, ort_threads: int | None = None) -> HostInfo:
    """This machine: CPU, probed int8 kernel family, package versions and thread settings."""
    import importlib.metadata as md

    import torch

    versions = {"python": _platform.python_version()}
    for pkg in ("netquant", "torch", "onnx", "onnxruntime", "numpy", "openvino", "ai-edge-litert", "ncnn"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    threads = {"torch threads": str(torch_threads if torch_threads is not None else torch.get_num_threads()),
               "onnxruntime intra-op threads": str(ort_threads) if ort_threads is not None else "default (all cores)",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset")}
    return HostInfo(cpu=cpu_info(), accumulation=host_accumulation(), versions=versions, threads=threads)
