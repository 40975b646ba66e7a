"""PyTorch's large CPU buffers on huge pages (engine/huge_pages.py): the decision, the
probe that says whether it took effect, and what the served plan reports."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tailserve.engine import huge_pages

LINUX_THP = huge_pages.kernel_thp_mode() in ("always", "madvise")

# A subprocess: optionally makes a tensor first, then does what the worker does before it
# loads, and prints the result, whether the variable is set, and the flags of the mapping
# that holds a 16 MiB tensor made afterwards.
_PROBE = """
import os, sys
from tailserve.engine import huge_pages
if sys.argv[1] == "tensor-first":
    import torch
    torch.zeros(16)
in_force, why = huge_pages.enable_for_engine(True)
import torch
t = torch.ones(4 << 20)
print(in_force, os.environ.get(huge_pages.ENV), "hg" in huge_pages._vm_flags("/proc/self/smaps", t.data_ptr()))
print(why)
"""


def test_the_engine_sets_the_variable_on_a_cpu_unless_the_user_or_the_kernel_decided():
    on, why = huge_pages.decide({}, "madvise", cpu_device=True, platform="linux")
    assert on and "2 MiB pages" in why
    assert huge_pages.decide({}, "always", cpu_device=True, platform="linux")[0]
    assert huge_pages.decide({huge_pages.ENV: "0"}, "madvise", True, "linux") == (False, f"{huge_pages.ENV}=0 as set")
    assert huge_pages.decide({huge_pages.ENV: "1"}, "madvise", True, "linux")[0] is False  # already theirs
    off, why = huge_pages.decide({}, "never", cpu_device=True, platform="linux")
    assert not off and "are never" in why
    assert huge_pages.decide({}, None, cpu_device=True, platform="linux") == (
        False, "the kernel's transparent huge pages are unavailable")
    assert huge_pages.decide({}, "madvise", cpu_device=True, platform="darwin") == (False, "not Linux")
    assert huge_pages.decide({}, "madvise", cpu_device=False, platform="linux") == (False, "not a CPU device")


def test_a_variable_the_user_set_to_off_is_reported_as_theirs():
    # The probe stands for an allocator that obeys the given mapping: this process's own may
    # already be on huge pages (an engine started earlier in the same test worker set it).
    for value in ("0", "false", "OFF"):
        on, why = huge_pages.enable_for_engine(True, {huge_pages.ENV: value}, "madvise", probe=lambda: False)
        assert (on, why) == (False, f"{huge_pages.ENV}={value} as set")
    on, why = huge_pages.enable_for_engine(True, {huge_pages.ENV: "1"}, "madvise", probe=lambda: False)
    assert not on and why.startswith("not in force")
    env: dict[str, str] = {}
    assert huge_pages.enable_for_engine(True, env, "madvise", probe=lambda: True)[0] and env[huge_pages.ENV] == "1"


def test_a_gpu_engine_leaves_the_environment_alone():
    env: dict[str, str] = {}
    assert huge_pages.enable_for_engine(False, env, "madvise") == (False, "not a CPU device")
    assert env == {}


def test_the_kernel_mode_and_a_mappings_flags_are_read_from_their_files(tmp_path):
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert huge_pages.kernel_thp_mode(str(mode)) == "madvise"
    assert huge_pages.kernel_thp_mode(str(tmp_path / "missing")) is None
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000200000 rw-p 00000000 00:00 0 \n"
        "Size:               2048 kB\n"
        "VmFlags: rd wr mr mw me ac sd \n"
        "7f0000200000-7f0001200000 rw-p 00000000 00:00 0 \n"
        "AnonHugePages:     16384 kB\n"
        "VmFlags: rd wr mr mw me ac sd hg \n")
    assert "hg" in huge_pages._vm_flags(str(smaps), 0x7F0000300000)
    assert "hg" not in huge_pages._vm_flags(str(smaps), 0x7F0000000100)
    assert huge_pages._vm_flags(str(smaps), 0x10) == []
    assert huge_pages._vm_flags(str(tmp_path / "missing"), 0x7F0000300000) == []


@pytest.mark.skipif(not sys.platform.startswith("linux") or not LINUX_THP,
                    reason="needs Linux with transparent huge pages on 'always' or 'madvise'")
def test_in_a_fresh_process_the_allocator_takes_huge_pages_and_after_a_tensor_it_is_too_late():
    env = {k: v for k, v in os.environ.items() if k != huge_pages.ENV}

    def probe(mode: str) -> tuple[str, str]:
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        first, why = out.stdout.strip().splitlines()[-2:]
        return first, why

    first, why = probe("fresh")
    assert first == "True 1 True", (first, why)  # reported on, and a later large tensor is advised
    first, why = probe("tensor-first")
    assert first == "False 1 False", (first, why)  # set, but PyTorch had read it already
    assert why.startswith("not in force: this process made a CPU tensor")


def test_the_served_plan_reports_huge_pages(tiny_server):
    plan = httpx.get(tiny_server.url + "/health", timeout=30).json()["plan"]
    report = plan["cpu_huge_pages"]
    assert report.startswith(("on (", "off (")), report
    # The server set it itself, or inherited the "1" an in-process engine of this test run set.
    if LINUX_THP and os.environ.get(huge_pages.ENV, "1") == "1":
        assert report.startswith(("on (large CPU buffers", f"on ({huge_pages.ENV}=1 as set")), report
