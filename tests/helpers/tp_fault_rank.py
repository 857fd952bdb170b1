"""A tensor-parallel rank with a planted fault applied in the rank's own process: the ranks are
spawned interpreters, so a fault applied in the test's process does not reach them. A test sets
`ouro.lab.numerics.tp_run._tp_rank` to `functools.partial(faulted_rank, name, repo)`."""

from ouro.lab.numerics import tp_run
from ouro.lab.faults.patch import applied_in_process
from ouro.lab.faults import all_faults

_TP_RANK = tp_run._tp_rank


def faulted_rank(name: str, repo: str, *args):
    fault = next(f for f in all_faults() if f.name == name)
    with applied_in_process(fault, repo):
        return _TP_RANK(*args)
