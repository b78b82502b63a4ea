"""``python -m dtr.sim``: same as ``dtr-sim``."""
import sys

from dtr.sim.cli import main

sys.exit(main())
