"""A model zoo for recording logs (see dtr-sim record)."""
__all__: list = []
