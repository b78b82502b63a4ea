"""dtr-sim record (filled in by its module owner; registers nothing yet)."""
