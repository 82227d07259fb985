"""Shared adapters over external systems and models: feature store, Qdrant, embedders, checkpoints, the vision tower."""
