"""A logits processor for server tests (`ouro serve --logits-processors
tests.helpers.paced_steps:PacedSteps`, the repository root on the path): it sleeps a fixed time per
sampled token, so a request of N tokens runs at least N * delay seconds on any machine.
Timing-sensitive tests (overload, drain) need that floor: on a fast machine a tiny model can finish
a request before the test has sent the next one."""

import os
import time


class PacedSteps:
    def __init__(self, model_dir):
        self.delay = float(os.environ.get("OURO_TEST_TOKEN_DELAY", "0.02"))

    def __call__(self, prompt_ids, output_ids, logits):
        time.sleep(self.delay)
        return logits
