"""`python -m loopspec.cli`: the same command line as the `loopspec` script."""

import sys

from loopspec.cli import main

sys.exit(main())
