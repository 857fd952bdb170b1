"""What the stack emits and how anything is measured: the span tracer, the heartbeat, Chrome traces,
A/B verdicts, per-thread CPU, the machine's roofline and a step's cost. The lowest layer above
`config`: every package may import it; it imports nothing of ouro but `config`."""
