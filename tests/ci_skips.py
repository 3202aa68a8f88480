"""A pytest plugin (registered by tests/conftest.py): under CI, a skipped test is a failed one.

.ci/run installs everything the suite's optional tests need (vLLM, TRL, DeepSpeed, bitsandbytes, the trackers,
Playwright and Chromium) and sets AGRPO_CI=1. There, a test that skips for a missing component did not run although
it should have, so its report becomes a failure that says why it skipped; a module that skips at import (a top-level
importorskip) fails the same way. A skip whose cause no installation changes (the CPU lacks an instruction set, the
kernel refuses a namespace) stays a skip where the test says so with `@pytest.mark.ci_may_skip("<reason>")` and the
skip's reason starts with that text. Outside CI nothing changes: a laptop without vLLM still passes the rest.
"""

import os

import pytest


def enforced() -> bool:
    return os.environ.get("AGRPO_CI") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "ci_may_skip(reason): under CI (AGRPO_CI=1) a skip of this test whose reason "
                                       "starts with `reason` stays a skip; any other skip fails there")


def _reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _fail(report, reason: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI (AGRPO_CI=1), where .ci/run installs what the suite needs: {reason}. "
                       f"Install what it names, or mark a skip no installation can change with "
                       f"@pytest.mark.ci_may_skip")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (enforced() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _reason(report).removeprefix("Skipped: ")
    allowed = [m.args[0] for m in item.iter_markers("ci_may_skip")]
    if not any(reason.startswith(prefix) for prefix in allowed):
        _fail(report, reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if enforced() and report.skipped:
        _fail(report, _reason(report).removeprefix("Skipped: "))
