"""OpenAI-compatible serving: HTTP frontend, engine process, wire protocol, GLM chat fidelity."""
