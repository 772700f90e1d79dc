"""``vllm serve`` as operators run it, with or without kvtier: start, ask, measure, stop.

One driver for ``kvtier bench serve`` and the tests (``tests/engine/test_vllm_serve.py``). The
server runs through ``python -m kvtier.vllm serve`` (vLLM's own command line; see that module
for why) in a session of its own, so a stop can signal its whole process group as a terminal's
Ctrl-C does. Every process it starts carries ``KVBENCH_SERVER_MARK`` in its environment: what a
stop leaves running — vLLM's workers, kvtier's workers and reaper — is found by that mark, and
what it leaves on disk by the server's instance id and private ``TMPDIR``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.memory.shm import SHM_DIR
from kvtier_bench.vllm_leftovers import remove, vllm_shm_of

READY_TIMEOUT_S = 600.0  # a server starts in 20-66 s here, minutes beside a CPU hog
REQUEST_TIMEOUT_S = 600.0  # one completion of a few thousand tokens on a busy 2-core machine
STOP_TIMEOUT_S = 60.0  # vLLM's own shutdown, then kvtier's; seconds when the machine is quiet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connector_config(
    instance: str, storage: dict[str, Any], role: str = "kv_both", **extra: Any
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a server with kvtier."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"instance_id": instance, "storage": storage, **extra},
    }


@dataclass
class Server:
    """One ``vllm serve`` of ``model``; ``kvtier``: the connector's extra config, or None."""

    model: str
    workdir: Path
    kvtier: dict[str, Any] | None = None
    connector: dict[str, Any] | None = None  # another connector's --kv-transfer-config
    kv_bytes: int = 128 << 20
    max_model_len: int = 4096
    max_num_seqs: int = 8
    reserved_cpus: int | None = None  # VLLM_CPU_NUM_OF_RESERVED_CPU: the same for a fair pair
    tokenizer: bool = False  # the model directory has one; else prompts are token ids
    kv_role: str = "kv_both"  # kv_producer / kv_consumer: a prefill / decode instance
    tensor_parallel: int = 1  # ranks; on a 2-core machine TP=2 needs its own binding (env)
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    host: str = "127.0.0.1"  # where it listens (an address of ``netns``, if given)
    netns: str | None = None  # run inside this network namespace (``ip netns exec``; root)
    instance: str = field(default_factory=lambda: "srv" + uuid.uuid4().hex[:10])
    process: subprocess.Popen | None = None
    vllm_left: list[str] = field(default_factory=list)  # vLLM's /dev/shm objects ``stop`` removed
    _seen: dict[int, float] = field(default_factory=dict, repr=False)  # pid: its start time
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def tmpdir(self) -> Path:
        return self.workdir / "tmp"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def command(self) -> list[str]:
        cmd = ["ip", "netns", "exec", self.netns] if self.netns else []
        cmd += [sys.executable, "-m", "kvtier.vllm", "serve", self.model]
        cmd += ["--host", self.host, "--port", str(self.port), "--dtype", "float32"]
        cmd += ["--enforce-eager", "--enable-prefix-caching", "--seed", "0"]
        cmd += ["--kv-cache-memory-bytes", str(self.kv_bytes)]
        cmd += ["--max-model-len", str(self.max_model_len)]
        cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.tensor_parallel > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel)]
        if not self.tokenizer:
            cmd.append("--skip-tokenizer-init")
        if self.kvtier is not None:
            config = connector_config(self.instance, role=self.kv_role, **self.kvtier)
            cmd += ["--kv-transfer-config", json.dumps(config)]
        elif self.connector is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.connector)]
        return cmd

    def start(self) -> Server:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tmpdir.mkdir(exist_ok=True)
        self.port = self.port or free_port()
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        env.update(
            TMPDIR=str(self.tmpdir),  # kvtier's sockets and launch dirs: this server's own
            KVBENCH_SERVER_MARK=self.mark,
            VLLM_HOST_IP="127.0.0.1",
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
            **self.env,
        )
        if self.reserved_cpus is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(self.reserved_cpus)
        log = open(self.log_path, "ab")  # noqa: SIM115  (the server's, closed by the child)
        with log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds until ``/health`` answers; raises with the log's tail if the server died."""
        assert self.process is not None
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.process.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not ready in {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def post(self, path: str, body: dict | None = None, timeout_s: float = REQUEST_TIMEOUT_S):
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip().startswith("{") else text

    def complete(self, prompt: list[int] | str, max_tokens: int = 8) -> list[int]:
        """A greedy completion (temperature 0): the generated token ids."""
        answer = self.post(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        return list(answer["choices"][0]["token_ids"])

    def reset_prefix_cache(self, timeout_s: float = 120.0) -> None:
        """Empty vLLM's own prefix cache (blocks held by transfers are released first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.post("/reset_prefix_cache")
                return
            except urllib.error.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters, summed over label sets, by name."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#") or "_created" in line:
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def kvtier_stats(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Each rank's kvtier worker stats, asked as ``kvtier status`` does (an observer that
        keeps no worker alive). The workers count a save when they answer it; vLLM's metrics
        take a saver's counts only at its next step (an idle engine takes none)."""
        from kvtier.engine.client import Client
        from kvtier.ops.status import collect

        endpoints = sorted(f"ipc://{p}" for p in self.tmpdir.glob("kvtier-*/*-rank*.sock"))
        with Client.connect(endpoints, start_timeout_s=timeout_s, observer=True) as client:
            return collect(client, timeout_s)

    def saves(self, stats: list[dict[str, Any]] | None = None) -> tuple[int, int]:
        """(blocks stored or found stored, save tasks answered other than OK), every rank's
        workers together; ``stats``: from ``kvtier_stats``, else asked now."""
        ranks = self.kvtier_stats() if stats is None else stats
        saves = [rank.get("tasks", {}).get("save", {}) for rank in ranks]
        blocks = sum(s.get("blocks_written", 0) + s.get("blocks_skipped", 0) for s in saves)
        return blocks, sum(s.get("tasks", 0) - s.get("ok", 0) for s in saves)

    def wait_saved(self, blocks: int, before: tuple[int, int], bound_s: float) -> bool:
        """Wait until the saves since ``before`` (``saves()`` then) are answered — they are off
        the server's critical path, and on a loaded machine land seconds after its answer: True
        once ``blocks`` more blocks are stored, False once a save was answered other than OK
        (a fault) or after ``bound_s``. Answered saves and idle workers are no sign: a prompt's
        blocks may come in several saves, and at TP=2 each rank's vLLM worker sends its own."""
        stored, failed = before
        deadline = time.monotonic() + bound_s
        while True:
            now_stored, now_failed = self.saves()
            if now_stored >= stored + blocks:
                return True
            if now_failed > failed or time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def stop(self, how: str = "group", sig: int = signal.SIGINT) -> float:
        """Signal the group (a terminal's Ctrl-C) or the API server alone (a service manager);
        seconds until every process it started — kvtier's included — is gone. vLLM's own
        shared memory that it leaves is then removed (``vllm_left``; ``vllm_leftovers``)."""
        assert self.process is not None
        start = time.monotonic()
        mapped = self.vllm_shm()
        if self.process.poll() is None:
            if how == "group":
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise TimeoutError(
                f"vllm serve ignored {signal.Signals(sig).name}:\n{self.tail()}"
            ) from None
        deadline = start + STOP_TIMEOUT_S
        while (alive := self.marked()) and time.monotonic() < deadline:
            time.sleep(0.05)
        took = time.monotonic() - start
        if not alive:
            self.vllm_left = remove(mapped)
        return took

    def vllm_shm(self) -> set[Path]:
        """vLLM's own /dev/shm objects of this server (``kvtier_bench.vllm_leftovers``)."""
        return vllm_shm_of(self.tmpdir, self.tail(10**7), self._tree())

    def _tree(self) -> list[int]:
        """The server's process and its descendants, remembered for ``marked``."""
        import psutil

        if self.process is None:
            return []
        try:
            root = psutil.Process(self.process.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        for proc in tree:
            try:
                self._seen[proc.pid] = proc.create_time()
            except psutil.Error:
                continue
        return [proc.pid for proc in tree]

    def marked(self) -> list[int]:
        """Pids of live processes this server started: by the mark in their environment, and
        those of its process tree seen before (``stop`` looks): vLLM's processes retitle
        themselves, which overwrites the environment the mark is read from."""
        import psutil

        pids = []
        for proc in psutil.process_iter(["environ", "status"]):
            try:
                env = proc.info["environ"] or {}
                alive = proc.info["status"] != psutil.STATUS_ZOMBIE
                if alive and env.get("KVBENCH_SERVER_MARK") == self.mark:
                    pids.append(proc.pid)
            except (psutil.Error, OSError):
                continue
        for pid, created in self._seen.items():
            try:
                proc = psutil.Process(pid)
                same = proc.create_time() == created  # not a new process under a reused pid
                if same and proc.status() != psutil.STATUS_ZOMBIE and pid not in pids:
                    pids.append(pid)
            except psutil.Error:
                continue
        return pids

    def kill_marked(self) -> None:
        for pid in self.marked():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def leftovers(self) -> list[str]:
        """What this server left: kvtier files named for its instance, launch dirs, sockets,
        and processes still running."""
        found = [str(p) for p in SHM_DIR.glob(f"*{self.instance}*")]
        if self.tmpdir.exists():
            for path in self.tmpdir.rglob("*"):  # files; a directory only if a launch dir
                if "kvtier" in str(path.relative_to(self.tmpdir)) and (
                    not path.is_dir() or path.name.startswith("kvtier-launch-")
                ):
                    found.append(str(path))
        found += [f"pid {pid}" for pid in self.marked()]
        return found


@dataclass
class Router:
    """``vllm-router`` (vLLM's router, a Rust binary in the ``vllm-router`` wheel) in front of
    servers: ``args`` are its own (``--worker-urls A B --policy round_robin``, or
    ``--vllm-pd-disaggregation --prefill P --decode D``). A context manager."""

    args: list[str]
    workdir: Path
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Router:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        command = ["vllm-router", *self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.workdir / "router.log", "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:  # it waits for its workers' health, then listens
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited {self.process.returncode}: see router.log")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
