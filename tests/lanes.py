"""The lanes of the suite (issue 42): `make check` (``--lane=fast``) runs the tests marked none of LANE_MARKERS,
`make test` all of them; the markers, derived from the fixtures a test uses; the guard that fails a fast-lane test
which starts a heavy process. A pytest plugin: tests/conftest.py imports its hooks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

# --- the lanes: `make check` (--lane=fast) runs the tests marked none of LANE_MARKERS; `make test`, all of them ----
#
# Each marker (pyproject.toml) names what puts a test out of the fast lane: a vLLM engine, a server process, Ray, a
# browser, or seconds of work that start none of those (`slow`). A test with one is also marked `heavy`. A test gets
# them from the fixtures it uses, directly or through other fixtures (HEAVY_FIXTURES against item.fixturenames,
# which is transitive), or from a mark written on the test where its own body starts the process (on a parameter:
# pytest.param(..., marks=...)). In the fast lane a guard makes starting one raise, in this process and in every
# Python process it starts, and fails the test (even one that caught the error) naming the marker to add: no test
# is in the wrong lane silently.

LANE_MARKERS = ("engine", "server", "ray", "browser", "slow")
HEAVY_FIXTURES = {  # this file's fixtures by name; a test module's own as "path::name"
    "inprocess_engine": "engine",
    "api_server": "engine",
    "vllm_server": "server",
    "vision_server": "server",
    "redis_url": "server",
    "sample_corpus": "slow",  # built, then ingested (`ingested`, `reference_store`): seconds of model work
    "tests/test_bench.py::bench_run": "engine",  # `mmrag bench`
    "tests/test_bench_e2e.py::e2e_run": "engine",
    "tests/test_bench_figures.py::figures_run": "engine",
    "tests/test_bench_image_input.py::image_input_run": "engine",
    "tests/test_families.py::engine": "engine",
    "tests/test_families_remote.py::engine": "server",  # `vllm serve`
    "tests/test_faults_replica.py::doomed": "server",
    "tests/test_pixel_bounds.py::service": "server",  # `mmrag vision serve`
    "tests/test_faults_store.py::own_redis": "server",
    "tests/test_faults_store.py::redis_app": "server",
    "tests/test_deploy.py::prometheus": "server",
    "tests/test_prometheus.py::prometheus": "server",
    "tests/test_ray_serve.py::ray_cluster": "ray",
    "tests/test_ui.py::browser": "browser",
}
# --- the whole suite on two workers (`make test`: pytest-xdist, --dist loadgroup) -------------------------------
#
# A session fixture is started once per worker that uses it, a module fixture once per worker that runs a test of
# its module. So every heavy test goes in a group that one worker runs whole: its module's, and one group for all the
# modules that use the session's engines (the in-process engine, the API server on it, the `vllm serve` replica,
# the browser on the API server), one for those using the vision service. Tests in no heavy group (the fast lane)
# go one at a time to whichever worker is free. Groups are handed out in the order of their items, largest first
# (SLOWEST below: a scheduling hint, seconds in one process on the Xeon 6 of issue 42's profile; a module not in
# it goes after them), so the long ones start at once and the fast tests fill the end.
SESSION_GROUPS = {"inprocess_engine": "session-engines", "api_server": "session-engines",
                  "vllm_server": "session-engines", "browser": "session-engines", "vision_server": "vision-service"}
SLOWEST = {"session-engines": 500, "tests/test_ingest.py": 66, "tests/test_ray_serve.py": 62,
           "tests/test_jobs.py": 59, "tests/test_bench.py": 51, "tests/test_reencode.py": 39,
           "tests/test_faults_process.py": 36, "tests/test_families.py": 27, "vision-service": 26,
           "tests/test_families_remote.py": 25, "tests/test_wiring.py": 20, "tests/test_bench_transfer.py": 19,
           "tests/test_retrieval.py": 14, "tests/test_corpus.py": 13, "tests/test_deploy.py": 11}
GROUPS_ENV = "MMRAG_TEST_GROUPS"  # where the workers write each test's group for the controller
GUARD_ENV = "PYTEST_FAST_LANE_GUARD"  # the guard's record file; its folder holds the sitecustomize.py children load


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--lane", choices=("all", "fast", "heavy"), default="all",
                     help="fast: the tests marked none of engine, server, ray, browser, slow, and starting one of "
                          "those fails (make check); heavy: the others; all: the whole suite (make test, default)")


def _fast_lane_guard(child: bool = False) -> None:
    """Make starting a heavy process record what it was and raise, in this process and, through the sitecustomize.py
    beside the record file (first on PYTHONPATH), in every Python process it starts. Self-contained: its source is
    that file. Patches subprocess.Popen (by command line: servers, chromium, Ray) and vLLM's EngineCore (an engine,
    in whichever process builds it: a forked engine core inherits the patch, a spawned one loads the
    sitecustomize), and in a child refuses `import torch` (`slow`: seconds a process, 10-15 s with the mmrag stack
    or vLLM), each on first import."""
    import importlib.machinery
    import json
    import os
    import sys

    if not os.environ.get("PYTEST_FAST_LANE_GUARD"):
        return

    def guarded_path(pythonpath: str) -> str:
        """PYTHONPATH with the guard's folder first: its sitecustomize is the one Python loads. But second behind
        mmrag/adapters/isa_caps (an emulated run, `make check-avx2`), whose sitecustomize loads instead, as the CLI's
        check of its caps expects: the children of an emulated run are guarded by their command line only."""
        guard = os.path.dirname(os.environ["PYTEST_FAST_LANE_GUARD"])
        parts = [p for p in pythonpath.split(os.pathsep) if p and p != guard]
        parts.insert(1 if parts and os.path.basename(parts[0].rstrip(os.sep)) == "isa_caps" else 0, guard)
        return os.pathsep.join(parts)

    os.environ["PYTHONPATH"] = guarded_path(os.environ.get("PYTHONPATH", ""))  # for the processes it starts
    state = getattr(sys, "_fast_lane_guard", None)
    if state is not None:  # installed at start-up by the sitecustomize: this is pytest started by pytest (xdist)
        state.pop("torch", None)
        return
    # Read when refusing, not now: a pytest process started by another (an xdist worker) records in its own file.

    def refuse(marker: str, what: str) -> None:
        with open(os.environ["PYTEST_FAST_LANE_GUARD"], "a") as f:
            f.write(json.dumps({"marker": marker, "what": what, "pid": os.getpid()}) + "\n")
        raise RuntimeError(f"the fast lane (make check) starts no heavy process, and this started {what}: "
                           f"mark the test @pytest.mark.{marker} (tests/conftest.py, the lanes)")

    def heavy_command(args, shell: bool) -> tuple[str, str] | None:
        import shlex

        argv = shlex.split(os.fsdecode(args)) if isinstance(args, (str, bytes)) and shell else (
            [os.fsdecode(args)] if isinstance(args, (str, bytes, os.PathLike)) else [os.fsdecode(a) for a in args])
        if len(argv) > 2 and os.path.basename(argv[0]) in ("sh", "bash") and argv[1] == "-c":
            argv = shlex.split(argv[2])
        if not argv:
            return None
        prog, rest = os.path.basename(argv[0]), argv[1:]
        if prog.startswith("python"):
            while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
                rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]
            if not rest or rest[0] == "-c":
                return None
            prog, rest = (rest[1], rest[2:]) if rest[0] == "-m" and len(rest) > 1 else (os.path.basename(rest[0]),
                                                                                      rest[1:])
        if "--help" in rest or "-h" in rest:
            return None
        words = [a for a in rest if not a.startswith("-")]
        if prog in ("mmrag", "mmrag.__main__", "mmrag.cli"):
            if words[:1] == ["serve"] or words[:2] in (["engine", "serve"], ["vision", "serve"]):
                return "server", "`mmrag " + " ".join(words[:1] if words[0] == "serve" else words[:2]) + "`"
        if prog == "vllm" or prog.startswith("vllm.") or prog == "serving.vllm_launch":
            return "server", "`vllm serve`"
        if prog in ("redis-server", "prometheus"):
            return "server", prog
        if prog.startswith(("chromium", "chromedriver", "google-chrome")):
            return "browser", prog
        if prog in ("ray", "raylet", "gcs_server") or any(f"{os.sep}ray{os.sep}" in a and "site-packages" in a
                                                          for a in argv[:2]):
            return "ray", f"a Ray process ({prog})"
        return None

    def patch_subprocess(module) -> None:
        real = module.Popen.__init__

        def __init__(self, args, *rest, **kwargs):
            found = heavy_command(args, kwargs.get("shell", False))
            if found:
                refuse(*found)
            if kwargs.get("env") is not None:  # an explicit environment: the guard goes on in the child's
                env = dict(kwargs["env"], PYTEST_FAST_LANE_GUARD=os.environ["PYTEST_FAST_LANE_GUARD"])
                kwargs["env"] = dict(env, PYTHONPATH=guarded_path(env.get("PYTHONPATH", "")))
            real(self, args, *rest, **kwargs)

        module.Popen.__init__ = __init__

    def patch_engine_core(module) -> None:
        def __init__(self, *args, **kwargs):
            refuse("engine", "a vLLM engine")

        module.EngineCore.__init__ = __init__

    def refuse_torch(module) -> None:
        refuse("slow", "a Python process that imports torch (seconds each; 10-15 s with the mmrag stack)")

    pending = {"subprocess": patch_subprocess, "vllm.v1.engine.core": patch_engine_core}
    if child:
        pending["torch"] = refuse_torch
    sys._fast_lane_guard = pending
    for name in [n for n in pending if n in sys.modules]:
        pending.pop(name)(sys.modules[name])

    class PatchOnImport:
        @staticmethod
        def find_spec(name, path=None, target=None):
            patch = pending.get(name)
            spec = patch and importlib.machinery.PathFinder.find_spec(name, path)
            if not spec or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return None
            pending.pop(name)
            if patch is refuse_torch:
                refuse_torch(None)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, PatchOnImport)


_lane_violations: dict = {"path": None, "read": 0}


def _new_violations() -> list[dict]:
    """The guard's records since the last call (from this process and the processes it started)."""
    import json

    path = _lane_violations["path"]
    if path is None or not os.path.exists(path):
        return []
    with open(path) as f:
        f.seek(_lane_violations["read"])
        lines = f.read()
        _lane_violations["read"] = f.tell()
    return [json.loads(line) for line in lines.splitlines() if line.strip()]


class _HeavyFixtureGuard:
    """In the fast lane, a heavy fixture reached anyway (request.getfixturevalue, which item.fixturenames does not
    show) fails before it starts anything. A plugin, not a hook of this file: a session fixture's setup hook is
    called on the session, which this folder's conftest hooks do not see."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef) -> None:
        import json

        marker = _heavy_fixture(fixturedef)
        if marker:
            with open(_lane_violations["path"], "a") as f:
                f.write(json.dumps({"marker": marker, "what": f"the fixture {fixturedef.argname}"}) + "\n")
            raise RuntimeError(f"the fast lane (make check) starts no heavy process, and the fixture "
                               f"{fixturedef.argname} starts one: mark the test @pytest.mark.{marker}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup`: xdist's scheduler by scope, each test's scope its group from the workers' files."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once all workers have collected (schedule() runs then)
                path = Path(os.environ[GROUPS_ENV])
                found = sorted(path.parent.glob(path.name + ".gw*"))
                self.groups = json.loads(found[0].read_text()) if found else {}
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    # The controller (whose workers inherit its environment): a folder for the workers' groups.
    if getattr(config.option, "dist", "no") == "loadgroup" and GROUPS_ENV not in os.environ:
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="mmrag-test-groups-"))
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
        os.environ[GROUPS_ENV] = str(folder / "groups.json")
    if config.getoption("lane") != "fast":
        return
    import inspect
    import tempfile
    import textwrap

    guard_dir = Path(tempfile.mkdtemp(prefix="fast-lane-guard-"))
    config.add_cleanup(lambda: shutil.rmtree(guard_dir, ignore_errors=True))
    chain = textwrap.dedent("""
        # Then the sitecustomize this one hides, if any, but another guard's (a pytest started by pytest).
        import importlib.machinery as _machinery, importlib.util as _util, os as _os, sys as _sys
        _spec = _machinery.PathFinder.find_spec("sitecustomize", [
            p for p in _sys.path if not _os.path.basename(_os.path.abspath(p or ".")).startswith("fast-lane-guard-")])
        if _spec is not None and _spec.loader is not None:
            _spec.loader.exec_module(_util.module_from_spec(_spec))
    """)
    (guard_dir / "sitecustomize.py").write_text(textwrap.dedent(inspect.getsource(_fast_lane_guard))
                                               + "\n\n_fast_lane_guard(child=True)\n" + chain)
    record = guard_dir / "violations.jsonl"
    record.touch()
    _lane_violations["path"] = str(record)
    os.environ[GUARD_ENV] = str(record)
    _fast_lane_guard()
    config.pluginmanager.register(_HeavyFixtureGuard(), "fast-lane-fixture-guard")


def _heavy_fixture(fixturedef: pytest.FixtureDef) -> str | None:
    """The lane marker of a fixture: HEAVY_FIXTURES by name if this file's, by "path::name" if a test module's."""
    where = fixturedef.baseid  # "tests/test_x.py" for a module's fixture (parametrize arguments too), else a folder
    return HEAVY_FIXTURES.get(f"{where}::{fixturedef.argname}" if where.endswith(".py") else fixturedef.argname)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's lane markers from its fixtures, `heavy` on every test with one; then --lane's selection."""
    for item in items:
        have = {m.name for m in item.iter_markers()}
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        for name in item.fixturenames:
            marker = _heavy_fixture(defs[name][-1]) if defs.get(name) else None  # [-1]: the one the test gets
            if marker and marker not in have:
                item.add_marker(marker)
                have.add(marker)
        if have.intersection(LANE_MARKERS) and "heavy" not in have:
            item.add_marker("heavy")
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup (its dist is "no")
        _group_for_workers(items)
    lane = config.getoption("lane")
    if lane == "all":
        return
    keep = [item for item in items if (item.get_closest_marker("heavy") is None) == (lane == "fast")]
    if len(keep) < len(items):
        kept = set(keep)
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = keep


def _group_for_workers(items: list[pytest.Item]) -> None:
    """Each heavy test's group (its module's, or the session fixtures' it shares with other modules), written for
    the controller's scheduler (no xdist_group mark: xdist would rename the node ids the file is keyed by, on a
    pytest that reads its rename); the items in order: the groups by SLOWEST, the other heavy groups, the rest."""
    module_group: dict[str, str] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        shared = {SESSION_GROUPS[n] for n in item.fixturenames if n in SESSION_GROUPS}
        if shared:  # a module with tests on both: the engines' group, which starts the vision service too
            module_group[module] = min(shared | ({module_group[module]} if module in module_group else set()))
    group_of: dict[pytest.Item, str | None] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        heavy = item.get_closest_marker("heavy") is not None or module in module_group
        group_of[item] = module_group.get(module, module) if heavy else None
    rank = {None: (2, 0)}
    rank.update({g: (0, -SLOWEST[g]) if g in SLOWEST else (1, 0) for g in set(group_of.values()) if g is not None})
    items.sort(key=lambda item: rank[group_of[item]])  # stable: a group's tests keep their order
    # For the controller's scheduler (GroupScheduling), which sees only node ids: pytest 9 ignores the id that
    # xdist's own loadgroup rewrites (item._nodeid), so the groups travel in a file of each worker's.
    groups = os.environ.get(GROUPS_ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if groups and worker:
        Path(f"{groups}.{worker}").write_text(json.dumps({i.nodeid: g for i, g in group_of.items() if g}))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """In the fast lane, a phase in which a heavy process was started fails, even if the test caught the error."""
    report = yield
    found = _new_violations()
    if found:
        marker = found[0]["marker"]
        what = "; ".join(sorted({v["what"] for v in found}))
        message = (f"{item.nodeid} is in the fast lane (make check) and started {what}: add "
                   f"@pytest.mark.{marker} to the test (or pytestmark = pytest.mark.{marker} to its module)")
        report.outcome = "failed"
        report.longrepr = message if report.longrepr is None else f"{message}\n\n{report.longrepr}"
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    found = _new_violations()  # started outside any test (collection, a session fixture's teardown)
    if found:
        session.config.get_terminal_writer().line(
            "fast lane: heavy processes started outside a test: " + "; ".join(v["what"] for v in found), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --- the session's heavy fixtures and shared data --------------------------------------------------------------
