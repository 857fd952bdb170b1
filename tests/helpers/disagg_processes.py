"""Disaggregated roles as separate `ouro` processes and their /metrics and /health
(`disagg/test_disagg_stress.py`, `disagg/test_disagg_images_stress.py`)."""

import os
import subprocess
import sys
import time

import httpx

from tests.helpers.serve_helpers import ROOT


def start(args, log):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OURO_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "ouro.cli", *args], stdout=log, stderr=subprocess.STDOUT, env=env)


def metric(base, name):
    text = httpx.get(base + "/metrics", timeout=10).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0] == name)


def settled(base, names, timeout=20):
    """The gauges `names` once they all read 0, or as they stand at the deadline (heartbeats trail)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {n: metric(base, n) for n in names}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.3)


def health(base):
    try:
        return httpx.get(base + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None
