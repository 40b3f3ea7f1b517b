"""Serving-engine integrations (vLLM, HF transformers) and the local demo model."""
