"""`mmrag config show|reference`: the effective configuration, and its reference page, read from Settings itself.

Every setting's description and component are declared in mmrag/core/settings.py (``setting(...)``), so what `show`
prints and what docs/configuration.md says come from the one place the service reads. `show` builds Settings
exactly as the other commands do (``Settings()`` from MMRAG_* variables) and starts nothing; a value it cannot
take is a user error (one line naming the variable, exit code 2). Secrets never reach the output: a set
``*_key``/``*_secret``/``*_password``/``*_token`` setting shows ``***``, and a URL's password is masked wherever it
appears (``redis://:***@host``).

Registered in mmrag/cli.py as ``app.add_typer(config_app, name="config")``.
"""

from __future__ import annotations

import itertools
import json
import re
import types
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

import typer
from pydantic_settings import NoDecode
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo
    from mmrag.core.settings import Settings

config_app = typer.Typer(
    help="The configuration: every MMRAG_* variable, its effective value and where it came from (`show`), and the "
    "reference page of them all (`reference`, docs/configuration.md).",
    no_args_is_help=True)
err = Console(stderr=True)

Source = Literal["env", "default", "derived", "profile"]
MASK = "***"
# A setting whose name ends in one of these is a secret: its value is never printed, only whether it is set.
SECRET_SUFFIXES = ("key", "secret", "password", "token")
# scheme://user:password@ (user may be empty: redis://:password@host); the password is masked up to the URL's last
# `@`, so one with an unencoded `@` or `/` is masked whole (a path's `@` may mask more than the password: never less).
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:@/,]*):[^\s,]*@")
REFERENCE_PATH = Path("docs/configuration.md")
RENDER_COMMAND = f"mmrag config reference --write {REFERENCE_PATH}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One setting as `mmrag config show` reports it; ``value`` is JSON-able, with secrets masked."""

    component: str
    name: str  # the flat name (the variable without MMRAG_, lowercased)
    env: str
    setting: str  # where Settings holds it: engine.urls
    value: Any
    source: Source

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def is_secret(name: str) -> bool:
    return name.rsplit("_", 1)[-1].lower() in SECRET_SUFFIXES


def mask_url_passwords(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` in it as ``***`` (a comma-separated list of
    URLs too)."""
    return _URL_PASSWORD.sub(rf"\g<head>:{MASK}@", text)


def masked(name: str, value: Any) -> Any:
    if is_secret(name) and value not in ("", None, [], {}):
        return MASK
    if isinstance(value, list):
        return [masked(name, item) for item in value]
    return mask_url_passwords(value) if isinstance(value, str) else value


def _raw_env(environ: Mapping[str, str], env: str) -> str | None:
    """The variable as pydantic-settings reads it: names are case-insensitive (Settings is not case_sensitive)."""
    if env in environ:
        return environ[env]
    return next((v for k, v in environ.items() if k.upper() == env), None)


def _is_text(field: FieldInfo) -> bool:
    """A setting whose validated value is the variable's text itself, unless the code replaced it."""
    annotation = field.annotation
    return annotation is str or (get_origin(annotation) is Literal and all(isinstance(a, str)
                                                                               for a in get_args(annotation)))


def source_of(field: FieldInfo, variable: str, value: Any, environ: Mapping[str, str]) -> Source:
    """env: the variable is set (and taken as it is); derived: the code filled it in from other settings (the
    answer section maps a deprecated MMRAG_ANSWER_MODE name, and MMRAG_LAYOUT=per_page sets split); default."""
    raw = _raw_env(environ, variable)
    if raw is not None:
        return "derived" if _is_text(field) and raw != value else "env"
    return "default" if value == field.get_default(call_default_factory=True) else "derived"


def entries(settings: Settings, environ: Mapping[str, str]) -> list[Entry]:
    """Every setting, grouped by component (Settings' sections in COMPONENTS' order, the testing knobs last), then
    in the order its section declares them."""
    from pydantic import BaseModel

    from mmrag.core.settings import DevelopmentKnobs, declared
    from mmrag.wiring import development_model_dir

    knobs = DevelopmentKnobs()  # read in the development profile only (the wiring)
    every = declared()
    parts: dict[str, BaseModel] = {d.component: knobs if d.component == "testing" else getattr(settings, d.component)
                                   for d in every}
    shown = {component: part.model_dump(mode="json") for component, part in parts.items()}  # JSON-able values
    out = []
    for d in every:
        raw = getattr(parts[d.component], d.name)
        value, source = shown[d.component][d.name], source_of(d.info, d.variable, raw, environ)
        if d.flat == "model" and (tiny := development_model_dir(settings)) is not None:
            value, source = str(tiny), "profile"  # what resolve_model serves (built there on first use)
        out.append(Entry(d.component, d.flat, d.variable, d.path, masked(d.flat, value), source))
    return out


def as_variable(value: Any) -> Any:
    """A list or map setting as its variable writes it (mmrag/core/settings.py CommaList, CommaMap): `a,b`,
    `name=value,...`; any other value as it is."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
        return ",".join(f"{k}={v:g}" for k, v in value.items())
    return value


def _shown(value: Any) -> str:
    if value is None:
        return "(unset)"
    value = as_variable(value)
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value)


def render_show(rows: list[Entry]) -> str:
    """The text form: a block per component, a line per setting: variable, where Settings holds it, source,
    value."""
    width, path = max(len(e.env) for e in rows), max(len(e.setting) for e in rows)
    return "\n\n".join(
        "\n".join([f"{component}:", *(f"  {e.env:<{width}}  {e.setting:<{path}}  {e.source:<7}  {_shown(e.value)}"
                                      for e in group)])
        for component, group in itertools.groupby(rows, key=lambda e: e.component))


def load_settings() -> Settings:
    """Settings() as every command builds it; a value it cannot take: the user error's one line, exit code 2."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from mmrag.core.settings import Settings
    from mmrag.errors import describe

    try:
        return Settings()
    except (ValidationError, SettingsError) as exc:
        err.print(f"[red]error:[/] {escape(describe(exc))}")
        raise typer.Exit(2) from None


@config_app.command("show")
def show(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON list of {component, name, env, setting, "
                                          "value, source} instead of the text table.")] = False,
) -> None:
    """Print the effective configuration: every MMRAG_* variable, where Settings holds it (engine.urls), where its
    value came from, and the value, grouped by component (model, storage, vision, ingestion, retrieval, answer,
    engine, scheduler, api, tenants, ray, testing).

    The variables are read exactly as `mmrag serve` and the other commands read them, and nothing is started.

    Sources: env, set in the environment; default, not set, the built-in default; derived, filled in by mmrag from
    other settings (a deprecated MMRAG_ANSWER_MODE name, or MMRAG_LAYOUT=per_page); profile, MMRAG_MODEL left empty
    in the development profile, so the tiny random-weight test model under MMRAG_DATA_DIR.

    Secrets are masked: a set *_KEY, *_SECRET, *_PASSWORD or *_TOKEN variable shows ***, a URL's password too
    (redis://:***@host).

    A value mmrag cannot take exits with code 2, naming the variable to fix. What each setting means:
    docs/configuration.md (`mmrag config reference`).

    Example: MMRAG_PORT=9000 mmrag config show --json
    """
    import os

    settings = load_settings()
    rows = entries(settings, os.environ)
    if as_json:
        typer.echo(json.dumps([e.to_json() for e in rows]))
    else:
        typer.echo(render_show(rows))
    if not settings.model.name and settings.model.profile == "production":
        err.print("note: MMRAG_MODEL is empty in the production profile: `mmrag serve`, `ingest` and `ask` refuse to "
                  "start; set MMRAG_MODEL, or MMRAG_PROFILE=development to try mmrag with the tiny test model")


# --- the reference page (docs/configuration.md) -------------------------------------------------------------------

_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "text", Path: "path"}
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def type_of(field: FieldInfo) -> str:
    """The setting's type as an operator writes it: boolean, integer (with its bounds), one of `a`, `b`, ..."""
    annotation, optional = field.annotation, False
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        optional, annotation = len(args) < len(get_args(annotation)), args[0]
    plain = any(m is NoDecode or isinstance(m, NoDecode) for m in field.metadata)  # settings.py CommaList, CommaMap
    if get_origin(annotation) is Literal:
        text = "one of " + ", ".join(f"`{a}`" for a in get_args(annotation))
    elif get_origin(annotation) is dict:
        text = "map: `name=value` comma-separated, or a JSON object" if plain else "JSON object"
    elif get_origin(annotation) is list:
        text = "list: comma-separated, or a JSON list"
    else:
        text = _TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))
    bounds = [f"{sign} {getattr(m, attr):g}" for m in field.metadata for attr, sign in _BOUNDS if hasattr(m, attr)]
    return text + (f" ({', '.join(bounds)})" if bounds else "") + (", or unset" if optional else "")


def default_of(field: FieldInfo) -> str:
    from pydantic import TypeAdapter

    default = TypeAdapter(field.annotation).dump_python(field.get_default(call_default_factory=True), mode="json")
    if default is None:
        return "unset"
    if default in ("", [], {}):
        return "empty"
    default = as_variable(default)
    return f"`{default if isinstance(default, str) else json.dumps(default)}`"


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped, and outside code spans `<` too (else `<name>` reads as an HTML tag)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


_GENERATED = (f"<!-- Generated from mmrag/core/settings.py by `{RENDER_COMMAND}`: edit the settings' descriptions there "
              "and render again (tests/test_config_cmd.py fails while this file is stale). -->")
_INTRO = ("mmrag reads its configuration from `MMRAG_*` environment variables, one per setting below. `Settings` "
          "(mmrag/core/settings.py) holds them in a section per component, the column `setting` (`engine.urls` is "
          "`MMRAG_ENGINE_URLS`); in Python, `Settings(engine_urls=[...])` and `settings.replace(max_num_seqs=8)` "
          "also take the variables' names, lowercased, without `MMRAG_`. The testing knobs are `DevelopmentKnobs` "
          "beside it, read in the development profile only and refused in production. `mmrag config show` prints "
          "each one's effective value and where it came from "
          "(the environment, the default, or filled in by mmrag), secrets masked; `--json` for scripts. Booleans take "
          "`true` or `false`; lists are comma-separated; `MMRAG_TIERS` is JSON. The command line also reads "
          "`MMRAG_EMULATE_ISA` (README).")


def render_reference() -> str:
    """docs/configuration.md: a table per component of every setting's variable, type, default and description,
    from Settings' own fields."""
    from mmrag.core.settings import COMPONENTS, declared

    every = declared()
    groups = {c: [d for d in every if d.component == c] for c in COMPONENTS}
    groups = {c: fields for c, fields in groups.items() if fields}
    lines = ["# Configuration reference", "", _GENERATED, "", _INTRO, "",
             "Components: " + ", ".join(f"[{c}](#{c})" for c in groups) + "."]
    for component, fields in groups.items():
        lines += ["", f"## {component}", "", COMPONENTS[component], "",
                  "| variable | setting | type | default | description |", "|---|---|---|---|---|"]
        lines += [f"| `{d.variable}` | `{d.path}` | {_cell(type_of(d.info))} | {_cell(default_of(d.info))} | "
                  f"{_cell(d.info.description or '')} |" for d in fields]
    return "\n".join(lines) + "\n"


@config_app.command("reference")
def reference(
    write: Annotated[Path | None, typer.Option("--write", help=f"Write the page to this file (the committed one: "
                                               f"{REFERENCE_PATH}) instead of printing it.")] = None,
) -> None:
    """Render the configuration reference (Markdown): every setting's variable, type, default and description,
    a table per component, from mmrag/core/settings.py.

    docs/configuration.md is this page; after changing a setting, run `mmrag config reference --write
    docs/configuration.md` (a test fails while the committed page is stale).
    """
    text = render_reference()
    if write is None:
        typer.echo(text, nl=False)
        return
    write.write_text(text)
    err.print(f"configuration reference written to [bold]{escape(str(write))}[/]")
