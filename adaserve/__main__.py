"""`python -m adaserve`: the same CLI as the `adaserve` script."""

import sys

from adaserve.cli import main

sys.exit(main())
