"""What several tests share: comparison helpers, real servers and processes, scripted replies,
cases and runs one test module's tests and another's both use."""
