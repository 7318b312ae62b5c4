"""``python -m pwsim``: the ``pwsim`` command, for a checkout used without installing it."""

import sys

from pwsim.cli import main

sys.exit(main())
