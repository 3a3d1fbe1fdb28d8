"""Adapters that plug ferry refit and control into inference engines and RL frameworks as they
are (docs/INTEGRATIONS.md):

- ferry.integrations.vllm: FerryWorkerExtension (--worker-extension-cls), the weight transfer
  engine "ferry" (register()), lifecycle(): control's clear / update as sleep / wake_up;
- ferry.integrations.sglang: the custom weight loader (--custom-weight-loader), update_weights()
  through update_weights_from_tensor, lifecycle(): clear / update as release /
  resume_memory_occupation;
- ferry.integrations.verl: the CheckpointEngine "ferry" (register()).

Importing any of them imports no engine or framework: what subclasses their classes is built
on first use.
"""
__all__ = ["vllm", "sglang", "verl"]
