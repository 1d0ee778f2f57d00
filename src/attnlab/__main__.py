"""``python -m attnlab`` is the ``attnlab`` command."""

import sys

from attnlab.cli import main

sys.exit(main())
