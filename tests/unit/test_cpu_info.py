"""The one reader of /proc/cpuinfo (cpu_info.py) and what reads through it: the CPU's model
name (doctor, the benchmarks' CPU lines) and the kernel cache key's CPU signature."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from mlx_parallm_provider import cpu_info
from mlx_parallm_provider.models import qmatmul

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse4_2 avx avx2 fma

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse4_2 avx avx2 fma
"""

ARM64 = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd asimddp i8mm
CPU implementer\t: 0x41
"""


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(platform, "processor", lambda: "")


def test_the_model_name_is_the_first_model_name_line(machine: None) -> None:
    assert cpu_info.cpu_model_name(X86) == "AMD EPYC 9654 96-Core Processor"
    assert cpu_info.cpu_model_name(X86, with_machine=True) == "AMD EPYC 9654 96-Core Processor (x86_64)"


def test_without_a_model_name_line_the_processor_then_the_machine_name_is_used(machine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_info.cpu_model_name(ARM64) == "x86_64"  # platform.processor() is "" on Linux
    assert cpu_info.cpu_model_name(ARM64, with_machine=True) == "x86_64"  # no " (x86_64)" after a fallback
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert cpu_info.cpu_model_name(ARM64) == "arm"


def test_the_default_reads_proc_cpuinfo_and_falls_back_where_there_is_none(machine: None, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text(X86)
    monkeypatch.setattr(cpu_info, "CPUINFO", fake)
    assert cpu_info.cpuinfo_text() == X86
    assert cpu_info.cpu_model_name() == "AMD EPYC 9654 96-Core Processor"
    monkeypatch.setattr(cpu_info, "CPUINFO", tmp_path / "missing")  # macOS: no /proc
    assert cpu_info.cpuinfo_text() is None
    assert cpu_info.cpu_model_name() == "x86_64"


def test_the_kernel_cache_keys_cpu_signature_keeps_its_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sorted, deduplicated ``model name`` / ``flags`` / ``Features`` lines (kernels cached
    under keys made from it stay valid), else platform.processor()."""
    fake = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu_info, "CPUINFO", fake)
    fake.write_text(X86)
    assert qmatmul.cpu_signature() == "flags\t\t: fpu sse4_2 avx avx2 fma\nmodel name\t: AMD EPYC 9654 96-Core Processor"
    assert qmatmul.cpu_flags() == {"fpu", "sse4_2", "avx", "avx2", "fma"}
    fake.write_text(ARM64)
    assert qmatmul.cpu_signature() == "Features\t: fp asimd asimddp i8mm"
    assert qmatmul.cpu_flags() == {"fp", "asimd", "asimddp", "i8mm"}
    monkeypatch.setattr(cpu_info, "CPUINFO", tmp_path / "missing")
    monkeypatch.setattr(platform, "processor", lambda: "i386")
    assert qmatmul.cpu_signature() == "i386"
    assert qmatmul.cpu_flags() == set()
