"""``python -m dtr.cli``: the same as ``dtr-sim``."""
import sys

from dtr.cli import main

sys.exit(main())
