"""The engine layer: one async interface over vLLM, in-process or remote replicas (contract: mmrag/core/engine.py)."""
