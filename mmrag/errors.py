"""Exceptions that mean "the configuration or environment needs fixing": shown as one line, exit code 2.

Named by module and class, not imported: the modules that define them pull in Qdrant, torch and vLLM, and
``mmrag --help`` must not. An exception can only be raised once its class's module is imported, so
:func:`is_user_error` looks the classes up among the modules already loaded and imports nothing.
"""

from __future__ import annotations

import importlib
import re
import sys

USER_ERROR_NAMES: tuple[tuple[str, str], ...] = (
    ("mmrag.ask_cmd", "PageNotFoundError"),
    ("mmrag.wiring", "EngineNotConfiguredError"),
    ("mmrag.wiring", "ModelNotConfiguredError"),  # production without MMRAG_MODEL
    ("mmrag.wiring", "DevelopmentKnobError"),  # production with a benchmark or test knob set
    ("serving.engine.features", "MissingFeaturesError"),
    ("serving.engine.remote", "EngineUnavailableError"),
    ("retrieval.search", "RetrievalError"),
    ("rag.decompose", "BadQuestionError"),
    ("mmrag.adapters.qdrant", "IndexConfigError"),
    ("mmrag.core.payload", "PayloadError"),  # an index written by another version: reset and re-ingest
    ("mmrag.adapters.store", "FeatureStoreError"),
    ("mmrag.adapters.checkpoint", "ModelNotFoundError"),
    ("mmrag.adapters.families", "UnsupportedFamilyError"),  # a checkpoint of a family mmrag cannot encode for
    ("pydantic", "ValidationError"),  # Settings: an MMRAG_* variable with a bad value
    ("pydantic_settings", "SettingsError"),  # Settings: an MMRAG_* variable that is not the JSON it takes
    ("builtins", "FileNotFoundError"),
    ("mmrag.ask_cmd", "ArgumentError"),
)


def loaded_user_errors() -> tuple[type[BaseException], ...]:
    """The user-error classes whose modules are imported already (the only ones anything can have raised)."""
    return tuple(getattr(sys.modules[module], name) for module, name in USER_ERROR_NAMES if module in sys.modules)


def user_errors() -> tuple[type[BaseException], ...]:
    """Every user-error class, importing the modules that define them (heavy: tests and tools, not the CLI)."""
    return tuple(getattr(importlib.import_module(module), name) for module, name in USER_ERROR_NAMES)


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, loaded_user_errors())


def describe(exc: BaseException) -> str:
    """The one line shown for a user error. A bad MMRAG_* variable is named as the variable, with its value
    and what it takes, instead of pydantic's field-name report."""
    if type(exc).__name__ == "SettingsError" and (field := re.search(r'field "(\w+)"', str(exc))):
        # pydantic-settings names the field and keeps the JSON parser's complaint as the cause
        return f"MMRAG_{field[1].upper()} is not valid JSON: {exc.__cause__ or exc} (fix the environment variable)"
    errors = getattr(exc, "errors", None)
    title = str(getattr(exc, "title", ""))
    if not (title == "Settings" or title.endswith("Section")) or not callable(errors):
        return str(exc)
    parts = []
    for e in errors():  # a section's field is named by its variable (its validation alias); a flat name by itself
        name = str(e["loc"][-1]).upper() if e["loc"] else ""
        variable = name if name.startswith("MMRAG_") else f"MMRAG_{name}"
        where = f"{variable}={e['input']!r}: " if name else ""
        parts.append(where + e["msg"].removeprefix("Value error, "))
    return "; ".join(parts) + " (fix the environment variable)"
