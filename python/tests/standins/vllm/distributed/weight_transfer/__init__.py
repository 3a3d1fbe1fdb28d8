"""Stand-in for vllm/distributed/weight_transfer/__init__.py (exports the factory)."""
