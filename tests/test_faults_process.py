"""`kill -9` of a process that owns engines: its engine processes go with it, and a restart ends where an
uninterrupted run would (for `mmrag serve` mid-ingest that is tests/test_jobs.py's test, with the helpers here).

Real processes on 127.0.0.1: `mmrag serve` and `mmrag engine serve` with the tiny model (ENGINE_ENV: fp32,
eager), killed with SIGKILL; the process tree is read with psutil before the kill. vLLM's CPU build starts its
engine core with `spawn`, so these cover the spawn path. The mechanism itself (serving/engine/lifeline.py) is
first checked on small multiprocessing children under both start methods, and the engine-core entry under
`fork` (as on GPUs) with a stand-in for vLLM's body. Waits are bounded hang guards, not timing assertions; the
seconds the descendants took to go are printed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import API_KEY, ENGINE_ENV, free_port
from tests.test_ingest import cli_env
from tests.waiting import eventually_sync

REPO = Path(__file__).resolve().parents[1]
MMRAG = Path(sys.executable).parent / "mmrag"
GONE_GUARD_S = 120.0  # a hang guard on the descendants' exit
READY_GUARD_S = 900.0  # start-up on a shared 2-core machine: 20 s alone, minutes under load


def gone_after(procs: list[psutil.Process], limit_s: float = GONE_GUARD_S) -> tuple[float, list[str]]:
    """Seconds until every one of ``procs`` has exited (a zombie counts: it holds no memory), and the ones left
    after ``limit_s`` (a hang guard), as "pid name" strings."""
    start = time.monotonic()
    with contextlib.suppress(AssertionError):  # what is left is returned, for the caller's own message
        eventually_sync(lambda: not any(_alive(p) for p in procs), timeout=limit_s, what="the processes gone")
    return time.monotonic() - start, [f"{p.pid} {p.name()}" for p in procs if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def reap() -> Iterator[list[psutil.Process]]:
    """Processes a test saw; any still running at the end are killed, so a failed test leaves no orphan."""
    seen: list[psutil.Process] = []
    yield seen
    for p in seen:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def engine_processes(proc: subprocess.Popen, reap: list[psutil.Process]) -> list[psutil.Process]:
    """``proc``'s descendants; there must be a vLLM engine core among them."""
    tree = psutil.Process(proc.pid).children(recursive=True)
    reap.extend(tree)
    assert any("EngineCore" in p.name() for p in tree), [p.name() for p in tree]
    return tree


# --- the mechanism, on small multiprocessing children ------------------------------------------------------

PARENT = textwrap.dedent(r'''
    """A parent that starts one tied child and then sleeps; it prints what the test waits for (one write a line:
    parent and child share the pipe)."""
    import multiprocessing, os, sys, threading, time
    from pathlib import Path

    from serving.engine.lifeline import die_with


    def child(tied, go: str | None) -> None:
        while go and not Path(go).exists():  # "late": tie only once the test says so (the parent is gone)
            time.sleep(0.05)
        die_with(multiprocessing.parent_process().pid)
        tied.set()
        os.write(1, b"tied\n")
        time.sleep(600)


    def engine_core(*args, **kwargs) -> None:  # stands in for vLLM's engine-core entry (its shape: lifeline.FENCE)
        os.write(1, b"tied\n")
        time.sleep(600)


    if __name__ == "__main__":
        method, how, go = sys.argv[1], sys.argv[2], (sys.argv[3:] or [None])[0]
        ctx = multiprocessing.get_context(method)
        if how == "engine-core":
            # vLLM's engine core cannot be forked with this CPU build (it forces spawn), so vLLM's entry is
            # replaced by a stand-in first; what is tested is the replacement entry vLLM would start.
            from vllm.v1.engine.core import EngineCoreProc
            from serving.engine.lifeline import tie_engine_cores_to_this_process

            EngineCoreProc.run_engine_core = staticmethod(engine_core)
            tie_engine_cores_to_this_process()
            proc = ctx.Process(target=EngineCoreProc.run_engine_core)  # as vLLM's CoreEngineProcManager does
        else:
            tied = ctx.Event()
            proc = ctx.Process(target=child, args=(tied, go))
        if how == "thread":
            # Started from a thread that exits once the child is tied: PR_SET_PDEATHSIG would fire then.
            starter = threading.Thread(target=lambda: (proc.start(), tied.wait()))
            starter.start()
            starter.join()
        else:
            proc.start()
        os.write(1, f"{proc.pid}\n".encode())
        time.sleep(600)
''')


@contextmanager
def parent(tmp_path: Path, method: str, how: str, *extra: str) -> Iterator[tuple[subprocess.Popen, psutil.Process]]:
    """The PARENT script running; yields it and its child once the child has said "tied" (unless "late")."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, str(script), method, how, *extra], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)
    child = None
    try:
        lines = [proc.stdout.readline().strip() for _ in range(1 if how == "late" else 2)]
        assert all(lines), f"the parent script stopped early (exit {proc.poll()}): {lines}"
        child = psutil.Process(next(int(x) for x in lines if x.isdigit()))
        yield proc, child
    finally:
        proc.kill()
        proc.wait()
        if child is not None and _alive(child):
            child.kill()  # a failed test leaves no orphan


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_tied_child_dies_with_its_parent_killed_9(tmp_path, method):
    with parent(tmp_path, method, "main") as (proc, child):
        assert _alive(child)
        proc.send_signal(signal.SIGKILL)
        seconds, left = gone_after([child])
        assert left == [], f"{method} child outlived its SIGKILLed parent"
    print(f"\n{method} child gone {seconds:.2f} s after its parent's SIGKILL")


def test_a_tied_child_outlives_the_thread_that_started_it(tmp_path):
    # PR_SET_PDEATHSIG would kill the child when the starting thread exits, although its process lives on.
    with parent(tmp_path, "fork", "thread") as (proc, child):
        # The starter thread has left the kernel too.
        eventually_sync(lambda: psutil.Process(proc.pid).num_threads() == 1, timeout=30,
                        what="the starter thread exited")
        time.sleep(1.0)  # room for a wrongly sent parent-death signal to land (scripts/test_waits.py: allowed)
        assert _alive(child), "the child died with the thread that started it, its parent process still living"
        proc.send_signal(signal.SIGKILL)
        assert gone_after([child])[1] == []


def test_a_child_that_ties_itself_after_its_parent_died_stops(tmp_path):
    go = tmp_path / "go"
    with parent(tmp_path, "spawn", "late", str(go)) as (proc, child):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _alive(child)  # reparented, untied so far
        go.touch()
        assert gone_after([child])[1] == [], "a child whose parent was already gone stayed"


@pytest.mark.slow
def test_a_forked_engine_core_entry_dies_with_its_parent(tmp_path):
    with parent(tmp_path, "fork", "engine-core") as (proc, child):
        proc.send_signal(signal.SIGKILL)
        assert gone_after([child])[1] == [], "the forked engine-core entry outlived its SIGKILLed parent"


# --- `mmrag serve`: kill -9 while an ingest job runs, restart, ingest again -----------------------------------


def serve_env(data_dir: Path, tiny_model: Path, root: Path) -> dict[str, str]:
    # Vision batch size 1 here and in the reference: batching may round differently, and features must match.
    return {**ENGINE_ENV, **cli_env(data_dir, tiny_model, MMRAG_VISION_BATCH_SIZE="1"), "MMRAG_WARM_TOP": "0",
            "MMRAG_API_KEY": API_KEY, "MMRAG_INGEST_ROOT": str(root), "MMRAG_ANSWER_MAX_TOKENS": "8"}


@contextmanager
def mmrag_serve(env: dict[str, str], log: Path) -> Iterator[tuple[subprocess.Popen, httpx.Client]]:
    """`mmrag serve` as a user starts it, ready (/readyz 200); stopped with SIGTERM at the end if still running."""
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen([str(MMRAG), "serve", "--port", str(port)], env=env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=60)

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"mmrag serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        return _ready(client)

    try:
        try:
            eventually_sync(ready, timeout=READY_GUARD_S, what="mmrag serve ready (/readyz 200)")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log.read_text()[-3000:]}") from None
        yield proc, client
    finally:
        client.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)


def _ready(client: httpx.Client) -> bool:
    try:
        return client.get("/readyz").status_code == 200
    except httpx.TransportError:
        return False


def wait_for_half_the_features(features: Path, expected) -> None:
    """Until an ingest in flight has written half the reference's feature entries: the moment to kill it."""
    half = len(expected[0]) // 2
    eventually_sync(lambda: len(list(features.glob("??/*.safetensors"))) >= half, timeout=600,
                    what=f"the ingest job wrote {half} feature entries")


# `kill -9` of `mmrag serve` mid-ingest, its engine processes gone and the restart ending with the uninterrupted
# corpus, is tests/test_jobs.py's test: the restart resumes the cut job there (one vLLM start-up fewer).


# --- vLLM's socket files: in a folder of the engine's process, gone with it ------------------------------------

SOCKETS = textwrap.dedent(r'''
    import os, socket, sys, uuid
    from serving.engine.lifeline import keep_engine_sockets_private
    path = keep_engine_sockets_private()
    assert os.environ["VLLM_RPC_BASE_PATH"] == path and keep_engine_sockets_private() is None  # idempotent
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(path, str(uuid.uuid4())))  # as vLLM's ZMQ binds ipc://$VLLM_RPC_BASE_PATH/<uuid>
    print(path, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), 9)
''')


@pytest.fixture
def sockets_tmpdir() -> Iterator[Path]:
    """A short temp folder for a child's TMPDIR (not tmp_path): vLLM's socket paths must stay under 108 bytes."""
    with tempfile.TemporaryDirectory(prefix="mmrag-t-", dir="/tmp") as tmp:
        yield Path(tmp)


def socket_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_socket()]


def sockets_run(tmpdir: Path, how: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    return subprocess.run([sys.executable, "-c", SOCKETS, how], env={**clean, "TMPDIR": str(tmpdir)},
                          cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("before", "after"), [("spawn", "fork"), ("fork", "fork"), (None, None)])
def test_a_cpu_engine_core_forks_its_worker_where_the_platform_forced_spawn(monkeypatch, before, after):
    """The start method vLLM's executor reads (lifeline.fork_the_workers): what vLLM's CPU platform forced to
    spawn becomes fork in the engine core; a fork already chosen, or no choice, is left as it was."""
    from serving.engine import lifeline

    if before is None:
        monkeypatch.delenv(lifeline.START_METHOD_VAR, raising=False)
    else:
        monkeypatch.setenv(lifeline.START_METHOD_VAR, before)
    lifeline.fork_the_workers()
    assert os.environ.get(lifeline.START_METHOD_VAR) == after


def test_engine_sockets_live_in_a_folder_of_their_process_removed_at_exit_or_by_the_next_start(sockets_tmpdir):
    tmpdir = sockets_tmpdir  # the children's TMPDIR
    ran = sockets_run(tmpdir, "exit")
    assert ran.returncode == 0, ran.stderr
    folder = Path(ran.stdout.strip())
    assert folder.parent == tmpdir and not folder.exists() and socket_files(tmpdir) == []
    killed = sockets_run(tmpdir, "kill")  # SIGKILL: nothing of it runs at exit, its folder stays ...
    assert killed.returncode == -9
    left = Path(killed.stdout.strip())
    assert socket_files(tmpdir) == [*left.iterdir()] and len(socket_files(tmpdir)) == 1
    alive = tmpdir / f"mmrag-vllm-{os.getpid()}-x"  # ... until a later start removes it; a living owner's stays
    alive.mkdir()
    ran = sockets_run(tmpdir, "exit")
    assert ran.returncode == 0, ran.stderr
    assert not left.exists() and alive.exists() and socket_files(tmpdir) == []
    # A folder set by the user is the user's: kept, and used as it is.
    mine = tmpdir / "mine"
    mine.mkdir()
    kept = subprocess.run([sys.executable, "-c", "from serving.engine.lifeline import keep_engine_sockets_private"
                           " as k; import os; print(k(), os.environ['VLLM_RPC_BASE_PATH'])"],
                          env={**os.environ, "VLLM_RPC_BASE_PATH": str(mine)}, cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert kept.stdout.split() == ["None", str(mine)], kept.stderr


# --- exit_promptly: the process ends when its work is done ------------------------------------------------------

PROMPT_EXIT = textwrap.dedent("""
    import atexit, os, sys

    atexit.register(os.write, 2, b"teardown noise")  # registered before: runs after exit_promptly's hook
    if sys.argv[1] == "promptly":
        from serving.engine.lifeline import exit_promptly

        exit_promptly()

    class Cycle:  # in a reference cycle: only a garbage collection finalizes it
        def __init__(self, path):
            self.me, self.file = self, open(path, "w")  # a file never closed: its buffered write must land

        def __del__(self, open=open, path=sys.argv[2]):  # builtins are gone by then
            open(path, "w").write("collected")

    def later_hook():
        open(sys.argv[3], "w").write("ran")
        print("a hook's last words", file=sys.stderr)

    atexit.register(later_hook)  # registered after exit_promptly: it must still run, and be heard
    keep = Cycle(sys.argv[4])
    keep.file.write("written, never closed")
    print(os.environ.get("PYTHONWARNINGS", ""))
    print("x" * 100_000, end="")  # a large unterminated write: flushed all the same
    print("said before the end", file=sys.stderr)
    sys.exit(3)
""")


def test_a_servers_heap_is_frozen_after_start_up_and_what_it_makes_later_is_still_collected():
    """serving/api/startup.freeze_heap, as `mmrag serve` calls it once started: what is alive then is frozen (the
    collector skips it), and garbage made afterwards is collected as before."""
    import gc
    import weakref

    from serving.api.startup import freeze_heap

    class Node:
        pass

    kept = Node()
    frozen = freeze_heap()
    # What freeze_heap counted is what it froze; the count can only fall afterwards (another thread of this test
    # process may drop the last reference to a frozen object, which leaves the permanent generation), never rise.
    assert frozen > 0 and gc.get_freeze_count() <= frozen
    assert not any(obj is kept for obj in gc.get_objects())  # frozen: in no generation the collector walks
    later = Node()
    later.self = later  # a cycle: only the collector frees it
    gone = weakref.ref(later)
    del later
    gc.collect()
    assert gone() is None


def test_exit_promptly_skips_the_final_collection_and_its_noise_and_keeps_everything_else(tmp_path):
    def run(how: str) -> tuple[subprocess.CompletedProcess, Path, Path, Path]:
        collected, hook, unclosed = (tmp_path / f"{how}-{what}" for what in ("collected", "hook", "unclosed"))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
        done = subprocess.run([sys.executable, "-c", PROMPT_EXIT, how, str(collected), str(hook), str(unclosed)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        return done, collected, hook, unclosed

    plain, collected, hook, unclosed = run("plain")  # the control: what the interpreter does by itself
    assert plain.returncode == 3 and collected.exists() and hook.exists(), plain.stderr
    assert plain.stderr.endswith("teardown noise") and unclosed.read_text() == "written, never closed"
    prompt, collected, hook, unclosed = run("promptly")
    assert prompt.returncode == 3  # the exit code is the program's
    warnings, _, rest = prompt.stdout.partition("\n")
    assert rest == "x" * 100_000  # stdout complete
    assert warnings == "ignore::UserWarning:multiprocessing.resource_tracker"  # for the tracker it starts later
    assert hook.read_text() == "ran"  # the later exit hook ran, and was heard; what ran after it was not
    assert prompt.stderr.splitlines() == ["said before the end", "a hook's last words"]
    assert unclosed.read_text() == "written, never closed"  # flushed though never closed ...
    assert not collected.exists()  # ... while the cycle was never collected: no final collection


# --- `mmrag engine serve`: the launcher killed, its `vllm serve` replica goes with it ----------------------------


@pytest.mark.server
def test_kill_9_of_the_engine_launcher_takes_its_vllm_replica_and_engine_core_down(tmp_path, tiny_model, reap,
                                                                                    sockets_tmpdir):
    port = free_port()
    env = {**ENGINE_ENV, **cli_env(tmp_path / "data", tiny_model), "TMPDIR": str(sockets_tmpdir)}
    env.pop("VLLM_RPC_BASE_PATH", None)
    log = tmp_path / "engine.log"
    with log.open("wb") as err:
        proc = subprocess.Popen([str(MMRAG), "engine", "serve", "--port", str(port), "--ready-timeout",
                                 str(READY_GUARD_S)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    reap.append(psutil.Process(proc.pid))
    line = proc.stdout.readline().strip()  # printed once the replica answers /health
    assert line == f"MMRAG_ENGINE_URLS=http://127.0.0.1:{port}", (line, log.read_text()[-3000:])
    tree = engine_processes(proc, reap)
    rss = sum(p.memory_info().rss for p in tree)
    proc.kill()
    proc.wait()
    seconds, left = gone_after(tree)
    assert left == [], f"the replica outlived its launcher: {left}"
    print(f"\nkill -9 of mmrag engine serve: {len(tree)} descendants ({rss / 2**20:.0f} MiB RSS) gone after "
          f"{seconds:.2f} s")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    # vLLM's sockets were in the replica's own folder, not loose in the temp folder; killed, it could not remove
    # them, and the next engine start does (the unit test above shows that start).
    folders = [p for p in sockets_tmpdir.iterdir() if p.name.startswith("mmrag-vllm-")]
    assert len(folders) == 1 and socket_files(folders[0]) == socket_files(sockets_tmpdir) != [], \
        sorted(map(str, sockets_tmpdir.rglob("*")))

