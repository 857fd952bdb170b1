"""The rank group a model step runs on, as the runner and the checkpointer call it by name.

A step on more than one process (tensor parallelism: `tp_workers.TPWorkers`) needs the other ranks
to run the same operation at the same moment, in the same order, so their collectives meet. The
runner says so before each operation it runs on this rank: `forward` (an eager forward of the flat
batch), `graph_step` (a compiled decode step), `warm_up` (the compiled graph's start-up), and the
checkpointer `checkpoint` (a KDA state copied into or out of a checkpoint). `LocalRanks` is the
group of one: nothing to tell anyone. A rank group has these four methods and `size`; nothing else
of the runner is replaced or hooked."""

from __future__ import annotations


class LocalRanks:
    """This process alone."""

    size = 1

    def forward(self, ids, ctx, candidates: int) -> None:
        """The other ranks run `model(ids, ctx)` with the head's `candidates` as this rank will."""

    def graph_step(self, ids, start_pos, slots, pages) -> None:
        """The other ranks run the compiled decode step with these arguments."""

    def warm_up(self) -> None:
        """The other ranks compile their decode step, bucket by bucket, as this rank is about to."""

    def checkpoint(self, op: str, a: int, b: int) -> None:
        """`op` ("save": slot a into checkpoint b; "restore": checkpoint a into slot b) on the other ranks."""
