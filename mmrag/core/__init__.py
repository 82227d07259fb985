"""Shared primitives: settings, typed keys and page types. Imports nothing else of mmrag."""
