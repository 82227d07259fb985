"""Exceptions that mean "the configuration or environment needs fixing": shown as one line, exit code 2."""

from __future__ import annotations

from pydantic import ValidationError

from ingestion.index import IndexConfigError
from ingestion.model_source import ModelNotFoundError
from ingestion.store import FeatureStoreError

from mmrag.ask_cmd import ArgumentError, PageNotFoundError
from serving.engine.factory import EngineNotConfiguredError
from serving.engine.features import MissingFeaturesError
from rag.decompose import BadQuestionError
from retrieval.search import RetrievalError
from serving.engine.remote import EngineUnavailableError

USER_ERRORS: tuple[type[Exception], ...] = (
    PageNotFoundError,
    EngineNotConfiguredError,
    MissingFeaturesError,
    EngineUnavailableError,
    RetrievalError,
    BadQuestionError,
    IndexConfigError,
    FeatureStoreError,
    ModelNotFoundError,
    ValidationError,
    FileNotFoundError,
    ArgumentError,
)
