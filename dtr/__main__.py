"""``python -m dtr``: what the runtime runs here (``info``), and building its native path (``build``)."""
import sys

from dtr.cli.runtime_info import main

sys.exit(main())
