"""Start a real `ouro serve` process on 127.0.0.1 for tests, and read its metrics."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds tests/: on the servers' path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir, *args, script=None, tmp_path=None, api_key=None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""), "OURO_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "ouro.cli", "serve", "--model", str(model_dir), "--port", str(self.port),
               "--max-memory", str(64 << 20), "--page-size", "16", *args]
        if script is not None:
            path = os.path.join(str(tmp_path), f"script-{self.port}.json")
            with open(path, "w") as f:
                json.dump(script, f)
            env["OURO_SCRIPTED_REPLY"] = path
            cmd += ["--logits-processors", "tests.helpers.scripted_logits:ScriptedReply"]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(os.path.join(str(tmp_path), f"server-{self.port}.log"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self.wait_ready()
        except BaseException:       # nothing else stops a server whose constructor raised: its processes outlived the test
            self.stop()
            raise

    def wait_ready(self, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    @property
    def engine_pid(self) -> int:
        return int(re.search(r"engine process pid (\d+)", self.output()).group(1))

    def headers(self):
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict:
        text = httpx.get(self.base + "/metrics", headers=self.headers(), timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def metric(self, name: str) -> float:
        return next(v for k, v in self.metrics().items() if k.split("{")[0] == name)

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def idle(server, timeout=20):
    """Pools back to full and nothing running, read from /metrics."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        get = lambda n: next(v for k, v in m.items() if k.split("{")[0] == n)
        if (get("ouro:kv_pages_used") == 0 and get("ouro:state_slots_used") == 0 and get("ouro:num_requests_running") == 0
                and get("ouro:num_requests_waiting") == 0 and get("ouro:num_requests_in_flight") == 0):
            return True
        time.sleep(0.3)
    return False


def post(server, path, body, key=..., raw=None):
    """POST with the server's API key (key=None: none; or another key)."""
    key = server.api_key if key is ... else key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(server.base + path, content=raw, headers={**headers, "content-type": "application/json"},
                          timeout=30)
    return httpx.post(server.base + path, json=body, headers=headers, timeout=30)


def pids_running(marker: bytes) -> list[int]:
    """Processes whose command line contains `marker` (e.g. b"ouro.engine.tp_workers")."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker in f.read():
                        out.append(int(d))
            except OSError:
                pass
    return out
