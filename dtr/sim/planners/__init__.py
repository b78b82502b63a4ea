"""Static rematerialization planners (see dtr.sim.schedule)."""
__all__: list = []
