"""``python -m protofl``: the command line, as ``protofl``."""

import sys

from protofl.cli import main

sys.exit(main())
