"""tests/ci_skips.py: under .ci/run (AGRPO_CI=1) a skip is a failure, unless the test marks that skip as one no
installation changes; elsewhere skips stay skips. Checked on a small suite in a pytest subprocess."""

import os
import subprocess
import sys

from conftest import REPO

SUITE = {
    "test_sample.py": '''
import pytest

def test_needs_a_missing_package():
    pytest.importorskip("agrpo_no_such_package", reason="installed by .ci/run")

@pytest.mark.ci_may_skip("the CPU has no native bf16")
def test_skips_where_the_cpu_cannot():
    pytest.skip("the CPU has no native bf16 (AVX512-BF16 or AMX)")

@pytest.mark.ci_may_skip("the CPU has no native bf16")
def test_skips_for_another_reason_than_its_mark_allows():
    pytest.skip("vLLM is not installed")

@pytest.mark.xfail(reason="a known failure", strict=True)
def test_expected_to_fail():
    assert False

def test_runs():
    pass
''',
    "test_module_skip.py": 'import pytest\n\npytest.importorskip("agrpo_no_such_package")\n',
}


def run_suite(tmp_path, ci: bool) -> subprocess.CompletedProcess:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "AGRPO_CI"}
    env.update(PYTHONPATH=str(REPO / "tests"), COLUMNS="400", **({"AGRPO_CI": "1"} if ci else {}))
    # under CI as CI runs the suite, on two workers (pyproject.toml's addopts): the reports are made in the workers
    workers = ["-n", "2"] if ci else []
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "ci_skips", "-p", "no:cacheprovider", "-q", "-rA",
                           *workers, "--continue-on-collection-errors", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_under_ci_a_skip_fails_unless_marked_as_one_no_installation_changes(tmp_path):
    proc = run_suite(tmp_path, ci=True)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "FAILED test_sample.py::test_needs_a_missing_package - skipped under CI (AGRPO_CI=1)" in out
    assert "FAILED test_sample.py::test_skips_for_another_reason_than_its_mark_allows - skipped under CI" in out
    assert "ERROR test_module_skip.py - skipped under CI (AGRPO_CI=1)" in out
    assert "SKIPPED [1] test_sample.py" in out and "the CPU has no native bf16 (AVX512-BF16 or AMX)" in out
    assert "XFAIL test_sample.py::test_expected_to_fail" in out and "PASSED test_sample.py::test_runs" in out
    assert "installed by .ci/run" in out  # the failure says why it skipped


def test_outside_ci_skips_stay_skips(tmp_path):
    proc = run_suite(tmp_path, ci=False)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 4 skipped, 1 xfailed" in proc.stdout
