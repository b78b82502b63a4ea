"""dtr-sim subcommands (filled in by its module owner; registers nothing yet)."""
