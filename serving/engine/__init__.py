"""The engine layer: one async interface over vLLM, in-process or remote replicas."""

from serving.engine.base import Completion, Engine, KVCapacity, Layout, PromptPlan, SamplingSpec, Usage

__all__ = ["Completion", "Engine", "KVCapacity", "Layout", "PromptPlan", "SamplingSpec", "Usage"]
