"""Stand-in for the `vllm` package (python/tests/standins/README.md). Nothing of vLLM's top level is
transcribed: only the submodules ferry.integrations.vllm imports exist."""
