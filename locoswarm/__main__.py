"""`python -m locoswarm`: the same as the `locoswarm` command."""

import sys

from locoswarm.cli import main

sys.exit(main())
