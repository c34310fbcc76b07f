"""Entry points for code that does not train through DeepSpeed: ``torch_native`` is a
drop-in for PyTorch's experimental ``context_parallel`` (no DeepSpeed import)."""
