"""The waits of the test suite that can race: every test in tests/*.py that sleeps for a fixed time, polls in a
hand-written loop (with a deadline or, worse, without one), or compares the timings of two live things (issue 42).

    python scripts/test_waits.py          # prints each one found; exit 1 if one is not on the lists below

Read with Python's ``ast``, not with a regex, so a sleep in a string (a child process's script) or a comment is
not one, and ``from time import sleep as nap`` still is:

- **sleep**: ``time.sleep(c)``, ``asyncio.sleep(c)`` (anyio, trio) with ``c`` a constant other than 0 (a number,
  arithmetic of numbers, or a module constant). ``asyncio.sleep(0)`` is a yield to the event loop, not a wait on
  the clock: it is not listed.
- **poll**: a ``while`` loop whose body sleeps (any sleep, 0 included: a busy wait is a poll too; an
  ``event.wait(c)`` too), or a ``for`` loop whose body sleeps and breaks or returns on a condition. Each is said
  to have a deadline (a clock read or a name with "deadline" in it, or an enclosing ``asyncio.timeout``), a
  count (``for _ in range(n)``), or none. All of them are listed: tests/waiting.py's ``eventually`` is the one
  place that polls (it is not scanned).
- **timing**: an ``assert`` comparing two values measured on the clock (``time.monotonic()``,
  ``perf_counter()``, ``time()``, a response's ``elapsed``, or what a function returns from them), as when one
  live process is asserted faster than another. ``clock() < deadline`` is a hang guard, not one.
- **unawaited**: ``eventually(...)`` (tests/waiting.py's coroutines) called as a statement, not awaited: it
  waits for nothing. Never allowed.

Speed bounds (one clock-measured value against a constant) are printed after them, for information: they set
one live thing against a number, not two against each other, but each is a margin a loaded machine may eat.

Each finding is keyed by (file, function, kind); ALLOWED says for each allowed one why it is not a race, PENDING
lists those found in files other work of issue 42 converts (they fail nothing until then, and an entry that no
longer matches anything fails the run: delete it). tests/test_waits_inventory.py runs this in the fast lane.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HELPER = "tests/waiting.py"  # the one module that polls: not scanned

SLEEPS = {("time", "sleep"), ("asyncio", "sleep"), ("anyio", "sleep"), ("trio", "sleep")}
CLOCKS = {("time", name) for name in ("monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time",
                                      "time_ns")}
TIMING_ATTRIBUTES = {"elapsed"}  # httpx.Response.elapsed
AWAITED = {("tests.waiting", "eventually"), ("tests.waiting", "ingest_finished")}  # coroutines: awaited or no wait

# --- the lists: (file, function, kind) -> why ----------------------------------------------------------------------

# Not races: each entry says why the wait cannot fail a correct change.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("tests/test_faults_process.py", "test_a_tied_child_outlives_the_thread_that_started_it", "sleep"):
        "a negative check: 1 s for a wrongly sent parent-death signal to land after the starter thread is gone. "
        "With correct code the child lives however long the wait, so it cannot fail a correct change (on a slow "
        "machine it can only miss a regression); no event marks a signal that is never sent",
    ("tests/test_deploy.py", "feed", "poll"):
        "not a poll: a thread feeding steady traffic (a record per 50 ms, paced on its stop event, as a live "
        "server records it) to a real Prometheus until the fixture stops it, once Prometheus has scraped that "
        "traffic enough times (waited for with eventually); nothing waits on the pace",
    ("tests/test_load.py", "test_1000_concurrent_questions_are_answered_or_refused_with_429_none_5xx.watch",
     "poll"):
        "a sampler, not a wait: it records the peak questions, plans and RSS while the burst runs and stops on "
        "the burst's event. A missed sample can only under-read a peak, so it never fails a correct server",
    ("tests/test_load.py", "test_1000_concurrent_questions_are_answered_or_refused_with_429_none_5xx.watch",
     "sleep"):
        "the sampler's period (10 ms); nothing waits on it (see its poll entry)",
    ("tests/test_faults_replica.py", "LoopLag._run", "poll"):
        "a sampler, not a wait: it records the event loop's longest lag on 10 ms timers while the block runs and is "
        "cancelled when the block ends. A lag over 1 s only makes the cancel test run its round again (a stalled "
        "round proves nothing either way) and is printed beside a failure; nothing waits on it",
    ("tests/test_faults_replica.py", "LoopLag._run", "sleep"):
        "the sampler's 10 ms timer; nothing waits on it (see its poll entry)",
    ("tests/test_admission_wait.py",
     "test_a_burst_of_300_waits_its_turn_and_past_a_tiny_deadline_is_refused_at_once_honestly", "poll"):
        "a client doing what the API tells it: waiting out each Retry-After the server names, at most 3 times. "
        "What is under test is that header; each wait is the server's, never a guess of ours",
}

# Found in files that other work of issue 42 owns and converts (tests/conftest.py, the replica faults, admission
# waits, the benchmarks, Ray Serve, jobs). They fail nothing until then; delete each entry once it matches nothing.
PENDING: dict[tuple[str, str, str], str] = {}


# --- the scan ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Finding:
    path: str  # relative to the repository, as in the lists
    line: int
    function: str  # dotted: enclosing classes and functions; "<module>" at the top
    kind: str  # sleep, poll, timing or speed
    detail: str

    @property
    def key(self) -> tuple[str, str, str]:
        return self.path, self.function, self.kind

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.function}: {self.detail}"


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_LOOPS = (ast.While, ast.For, ast.AsyncFor)


class _Module:
    """Names of one module: what each imported name is, and its numeric module constants."""

    def __init__(self, tree: ast.Module) -> None:
        self.modules: dict[str, str] = {}  # local name -> module (import time as t)
        self.names: dict[str, tuple[str, str]] = {}  # local name -> (module, name) (from time import sleep)
        self.constants: dict[str, float] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.modules[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    self.names[a.asname or a.name] = (node.module, a.name)
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value = self.constant(node.value)
                if value is not None:
                    self.constants[node.targets[0].id] = value

    def qualified(self, func: ast.expr) -> tuple[str, str] | None:
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in self.modules:
            return self.modules[func.value.id], func.attr
        if isinstance(func, ast.Name):
            return self.names.get(func.id)
        return None

    def is_sleep(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and self.qualified(node.func) in SLEEPS

    def is_timed_wait(self, node: ast.AST) -> bool:
        """``x.wait(c)``, ``x.wait(timeout=c)`` with a constant: an Event's or Condition's wait, which in a loop
        is a sleep that may end early."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "wait"):
            return False
        arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "timeout"), None)
        return self.constant(arg) is not None

    def is_clock(self, node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        if self.qualified(node.func) in CLOCKS:
            return True
        # loop.time() / asyncio.get_running_loop().time(): the event loop's clock
        return isinstance(node.func, ast.Attribute) and node.func.attr == "time" and not node.args and (
            (isinstance(node.func.value, ast.Name) and node.func.value.id == "loop")
            or (isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Attribute)
                and node.func.value.func.attr in ("get_running_loop", "get_event_loop")))

    def constant(self, node: ast.AST | None) -> float | None:
        """The value of a constant numeric expression, else None."""
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value,
                                                                                                     bool):
            return float(node.value)
        if isinstance(node, ast.Name):
            return self.constants.get(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.constant(node.operand)
            return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            left, right = self.constant(node.left), self.constant(node.right)
            if left is None or right is None or (isinstance(node.op, ast.Div) and right == 0):
                return None
            return {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right,
                    ast.Div: left / (right or 1)}[type(node.op)]
        return None

    def sleep_seconds(self, call: ast.Call) -> float | None:
        arg = call.args[0] if call.args else next(
            (k.value for k in call.keywords if k.arg in ("delay", "seconds", "secs")), None)
        return self.constant(arg)


def _walk_scope(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes under ``node`` that run in its own scope: not those of nested functions, lambdas or classes."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, _SCOPES):
            yield from _walk_scope(child)


def _scopes(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """("<module>", tree) and (dotted name, node) for every function in the module, classes included in names."""
    yield "<module>", tree

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def _source(path_text: str, node: ast.AST) -> str:
    return " ".join((ast.get_source_segment(path_text, node) or ast.dump(node)).split())


def _names(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            yield sub.id
        elif isinstance(sub, ast.Attribute):
            yield sub.attr


def _loops_around(node: ast.AST, parents: dict[ast.AST, ast.AST], scope: ast.AST) -> Iterator[ast.AST]:
    """The loops enclosing ``node`` within ``scope``, innermost first."""
    at = parents.get(node)
    while at is not None and at is not scope:
        if isinstance(at, _LOOPS):
            yield at
        at = parents.get(at)


def _exits(loop: ast.AST) -> bool:
    """The loop's body breaks out of it or returns (a for loop that stops on a condition)."""
    def walk(node: ast.AST, nested: bool) -> Iterator[ast.AST]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _SCOPES):
                continue
            if isinstance(child, ast.Break) and not nested:
                yield child
            elif isinstance(child, ast.Return):
                yield child
            yield from walk(child, nested or isinstance(child, _LOOPS))
    return any(True for _ in walk(loop, False))


def _timeout_around(node: ast.AST, parents: dict[ast.AST, ast.AST], scope: ast.AST, module: _Module) -> bool:
    at = parents.get(node)
    while at is not None and at is not scope:
        if isinstance(at, (ast.With, ast.AsyncWith)):
            for item in at.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and module.qualified(call.func) in (("asyncio", "timeout"),
                                                                                    ("asyncio", "timeout_at")):
                    return True
        at = parents.get(at)
    return False


def _deadline(loop: ast.AST, module: _Module) -> bool:
    return any(module.is_clock(n) for n in ast.walk(loop)) or any("deadline" in n.lower() for n in _names(loop))


REDUCERS = {"min", "max", "sum", "abs", "round", "float", "int", "sorted", "list", "tuple", "median", "mean",
            "fmean", "quantiles", "stdev", "total_seconds", "fsum", "ceil", "floor"}  # a timing in, a timing out


class _Timings:
    """Which values of a module are measured on the clock: names assigned from a clock read (or from arithmetic
    on, a reduction of, or a list of such values), and what functions return one (all of their value, or some
    positions of a returned tuple). Per scope, to a fixed point; functions are known by name."""

    def __init__(self, module: _Module, scopes: list[tuple[str, ast.AST]]) -> None:
        self.module = module
        self.functions: dict[str, set[int] | None] = {}  # name -> measured tuple positions, None: all of it
        self.tainted: dict[int, set[str]] = {}
        for _ in range(6):
            before = (repr(self.functions), repr(self.tainted))
            for _, scope in scopes:
                self._scope(scope)
            if before == (repr(self.functions), repr(self.tainted)):
                break

    @staticmethod
    def _called(call: ast.Call) -> str | None:
        func = call.func
        return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None

    def measured(self, node: ast.AST, tainted: set[str]) -> bool:
        """Whether ``node``'s value is a timing (or a collection of timings)."""
        if isinstance(node, ast.Await):
            return self.measured(node.value, tainted)
        if self.module.is_clock(node):
            return True
        if isinstance(node, ast.Name):
            return node.id in tainted
        if isinstance(node, ast.Attribute):
            return node.attr in TIMING_ATTRIBUTES  # not r.after.busy of a measured r: a field is its own
        if isinstance(node, ast.Subscript):
            return self.measured(node.value, tainted)
        if isinstance(node, ast.BinOp):
            return self.measured(node.left, tainted) or self.measured(node.right, tainted)
        if isinstance(node, ast.UnaryOp):
            return self.measured(node.operand, tainted)
        if isinstance(node, ast.IfExp):
            return self.measured(node.body, tainted) or self.measured(node.orelse, tainted)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return any(self.measured(e, tainted) for e in node.elts)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            inner = tainted | {n.id for g in node.generators if self.measured(g.iter, tainted)
                               for n in ast.walk(g.target) if isinstance(n, ast.Name)}
            return self.measured(node.elt, inner)
        if isinstance(node, ast.Call):
            name = self._called(node)
            if name in self.functions:
                return self.functions[name] is None
            if name in REDUCERS:
                receiver = [node.func.value] if isinstance(node.func, ast.Attribute) and name == "total_seconds" else []
                return any(self.measured(a, tainted) for a in [*node.args, *receiver])
        return False

    def _positions(self, value: ast.AST, tainted: set[str]) -> set[int] | None:
        """The measured positions of a tuple ``value`` (None when it is not a tuple known position by position)."""
        if isinstance(value, ast.Await):
            return self._positions(value.value, tainted)
        if isinstance(value, ast.Tuple):
            return {i for i, e in enumerate(value.elts) if self.measured(e, tainted)}
        if isinstance(value, ast.Call) and self.functions.get(self._called(value), ...) not in (None, ...):
            return set(self.functions[self._called(value)])
        return None

    def _assign(self, target: ast.AST, value: ast.AST, tainted: set[str]) -> None:
        positions = self._positions(value, tainted) if isinstance(target, (ast.Tuple, ast.List)) else None
        if positions is not None:
            for i, element in enumerate(target.elts):
                if i in positions:
                    tainted.update(n.id for n in ast.walk(element) if isinstance(n, ast.Name))
        elif self.measured(value, tainted):
            tainted.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))

    def _scope(self, scope: ast.AST) -> None:
        tainted = self.tainted.setdefault(id(scope), set())
        for node in _walk_scope(scope):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._assign(target, node.value, tainted)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                self._assign(node.target, node.value, tainted)
            elif isinstance(node, ast.NamedExpr):
                self._assign(node.target, node.value, tainted)
            elif isinstance(node, (ast.For, ast.AsyncFor)) and self.measured(node.iter, tainted):
                tainted.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("append", "extend", "add", "insert")
                  and isinstance(node.func.value, ast.Name) and any(self.measured(a, tainted) for a in node.args)):
                tainted.add(node.func.value.id)
            elif (isinstance(node, ast.Return) and node.value is not None
                  and isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef))):
                positions = self._positions(node.value, tainted)
                known = self.functions.get(scope.name, set())
                if positions:
                    if known is not None:
                        self.functions[scope.name] = known | positions
                elif positions is None and self.measured(node.value, tainted):
                    self.functions[scope.name] = None

    def comparisons(self, scope: ast.AST) -> Iterator[tuple[ast.Assert, ast.Compare, int, bool]]:
        """Each comparison in an assert of ``scope`` that involves a timing: (assert, compare, how many of its
        operands are timings, whether the others are numeric constants). Hang guards are left out."""
        tainted = self.tainted.get(id(scope), set())
        for node in _walk_scope(scope):
            if not isinstance(node, ast.Assert):
                continue
            for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                operands = [compare.left, *compare.comparators]
                if any(self.module.is_clock(o) or any("deadline" in n.lower() for n in _names(o)) for o in operands):
                    continue  # clock() < deadline: a hang guard
                measured = [self.measured(o, tainted) for o in operands]
                if any(measured):
                    rest = [o for o, m in zip(operands, measured) if not m]
                    yield node, compare, sum(measured), all(self.module.constant(o) is not None for o in rest)


def scan_source(text: str, path: str) -> list[Finding]:
    """The findings of one module's source; ``path`` as the lists name it."""
    tree = ast.parse(text, filename=path)
    module = _Module(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    scopes = list(_scopes(tree))
    found: set[Finding] = set()
    for name, scope in scopes:
        for node in _walk_scope(scope):
            if module.is_sleep(node):
                seconds = module.sleep_seconds(node)
                if seconds is not None and seconds != 0:
                    found.add(Finding(path, node.lineno, name, "sleep", f"fixed sleep: {_source(text, node)}"))
            elif not module.is_timed_wait(node):
                continue
            for loop in _loops_around(node, parents, scope):
                if isinstance(loop, ast.While) or _exits(loop):
                    if _deadline(loop, module) or _timeout_around(loop, parents, scope, module):
                        how = "with a deadline"
                    elif not isinstance(loop, ast.While):
                        how = "bounded by a count, not a deadline"
                    else:
                        how = "WITHOUT a deadline"
                    head = _source(text, loop.test if isinstance(loop, ast.While) else loop.iter)
                    word = "while" if isinstance(loop, ast.While) else "for ... in"
                    found.add(Finding(path, loop.lineno, name, "poll",
                                      f"hand-written polling loop {how}: {word} {head}"))
                    break
    for name, scope in scopes:
        for node in _walk_scope(scope):
            if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                    and module.qualified(node.value.func) in AWAITED):
                found.add(Finding(path, node.lineno, name, "unawaited",
                                  f"a coroutine made and dropped, no wait at all: {_source(text, node.value)}"))
    timings = _Timings(module, scopes)
    for name, scope in scopes:
        for statement, compare, measured, against_constants in timings.comparisons(scope):
            if measured >= 2:
                found.add(Finding(path, statement.lineno, name, "timing",
                                  f"compares two timings: {_source(text, compare)}"))
            elif against_constants:
                found.add(Finding(path, statement.lineno, name, "speed",
                                  f"speed bound: {_source(text, compare)}"))
    return sorted(found)


def suite_modules(root: Path = REPO) -> list[Path]:
    return sorted(p for p in (root / "tests").glob("*.py") if p.relative_to(root).as_posix() != HELPER)


def scan(paths: Iterable[Path], root: Path = REPO) -> list[Finding]:
    return [f for p in paths for f in scan_source(p.read_text(), p.relative_to(root).as_posix())]


# --- the verdict ---------------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    new: list[Finding] = field(default_factory=list)
    allowed: list[Finding] = field(default_factory=list)
    pending: list[Finding] = field(default_factory=list)
    speed: list[Finding] = field(default_factory=list)
    stale: list[tuple[str, tuple[str, str, str]]] = field(default_factory=list)  # (list name, key)

    @property
    def ok(self) -> bool:
        return not self.new and not self.stale

    def report(self) -> str:
        lines = []
        for title, items in (("NOT ALLOWED (make it event-driven: tests/waiting.py's eventually, or a real "
                              "event; or, if it is no race, allow it in scripts/test_waits.py saying why)", self.new),
                             ("pending (files other work of issue 42 converts)", self.pending),
                             ("allowed (scripts/test_waits.py says why each is no race)", self.allowed),
                             ("speed bounds, for information (a clock-measured value against a constant)",
                              self.speed)):
            lines.append(f"{title}: {len(items)}")
            lines += [f"  {f}" for f in items]
        for which, key in self.stale:
            lines.append(f"STALE: {which} entry {key} matches nothing any more: delete it from scripts/test_waits.py")
        counted = self.new + self.pending + self.allowed
        kinds = {k: sum(f.kind == k for f in counted) for k in ("sleep", "poll", "timing")}
        lines.append(f"{len(counted)} found ({kinds['sleep']} fixed sleeps, {kinds['poll']} polling loops, "
                     f"{kinds['timing']} timing comparisons): {len(self.new)} not allowed, {len(self.pending)} "
                     f"pending, {len(self.allowed)} allowed; {len(self.speed)} speed bounds; "
                     f"{len(self.stale)} stale list entries")
        return "\n".join(lines)


def judge(findings: Iterable[Finding], allowed: dict = ALLOWED, pending: dict = PENDING,
          scanned: Iterable[str] | None = None) -> Verdict:
    """The findings sorted by the lists; an entry of a scanned file (``scanned``: all files when None) that
    matches nothing is stale."""
    verdict = Verdict()
    used: set[tuple[str, str, str]] = set()
    for f in sorted(findings):
        if f.kind == "speed":
            verdict.speed.append(f)
        elif f.kind == "unawaited":
            verdict.new.append(f)
        elif f.key in allowed:
            verdict.allowed.append(f)
            used.add(f.key)
        elif f.key in pending:
            verdict.pending.append(f)
            used.add(f.key)
        else:
            verdict.new.append(f)
    scanned = None if scanned is None else set(scanned)
    verdict.stale = [(name, key) for name, entries in (("ALLOWED", allowed), ("PENDING", pending))
                     for key in entries if key not in used and (scanned is None or key[0] in scanned)]
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="modules to scan (default: tests/*.py)")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.paths] or suite_modules()
    verdict = judge(scan(paths), ALLOWED, PENDING, scanned=[p.relative_to(REPO).as_posix() for p in paths])
    print(verdict.report())
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
