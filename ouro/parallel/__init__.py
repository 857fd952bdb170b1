"""Parallelism over torch.distributed: process groups (`groups`), context-parallel KDA (`cp_kda`)."""
