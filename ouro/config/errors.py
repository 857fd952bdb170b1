"""The error a checkpoint or its config earns (below every module of `config` that raises it)."""


class CheckpointError(ValueError):
    """A checkpoint directory or its config cannot be used; the message says what to fix."""
