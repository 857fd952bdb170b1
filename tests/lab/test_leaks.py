"""The leaks probe: every request path hands back what it took; a planted leak is named at the
function that lost the resource (faults applied in process, under their real file names)."""

import os

import pytest

from ouro.lab.faults.patch import Fault, applied_in_process
from ouro.lab.faults import all_faults
from ouro.lab.leaks.probe import PATHS, probe_leaks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_clean_engine_returns_everything_on_every_path():
    findings = probe_leaks("tiny")
    assert [f.severity for f in findings] == ["info"], [f.summary for f in findings]
    assert findings[0].measured == len(PATHS)


def _fault(name):
    return next(f for f in all_faults() if f.name == name)


def test_slot_dropped_on_abort_is_named_at_finish():
    with applied_in_process(_fault("scheduler_leaks_slot_on_abort"), REPO):
        findings = probe_leaks("tiny")
    top = findings[0]
    assert top.severity == "error" and "abort" in top.summary
    assert top.where["file"] == "ouro/engine/scheduler.py" and top.where["function"] == "finish"
    assert top.measured == {"slots": 1}


@pytest.mark.parametrize("skip", ["pages", "everything"])
def test_release_skipped_is_named_by_the_release_chain(skip):
    # finish() forgets to call free() on abort (everything) or free() keeps short requests' pages
    if skip == "everything":
        fault = Fault("t", "", "ouro/engine/scheduler.py", "Scheduler.finish",
                      [("self.free(req)", "if reason != 'abort':  # FAULT\n    self.free(req)\nelse:\n    pass")], [{}], [[]])
        want = "finish"
    else:
        fault = Fault("t", "", "ouro/engine/scheduler.py", "Scheduler.free",
                      [("if own:", "if own and len(req.output_ids) >= 3:  # FAULT: short requests keep their pages")],
                      [{}], [[]])
        want = "free"
    with applied_in_process(fault, REPO):
        findings = probe_leaks("tiny")
    top = findings[0]
    assert top.severity == "error", [f.summary for f in findings]
    assert top.where["file"] == "ouro/engine/scheduler.py" and top.where["function"] == want, top.summary
