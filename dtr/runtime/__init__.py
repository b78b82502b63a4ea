"""The PyTorch runtime: ``dtr.budget`` (a TorchDispatchMode over the C++ core)."""
__all__: list = []
