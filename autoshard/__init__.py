"""autoshard: automatic parallelization compiler for PyTorch."""
