"""`python -m tfdist_launch`, or `python launch/tfdist_launch` (the directory, run
as a script: stdlib only, so it runs with nothing installed)."""

import os
import sys

if not __package__:   # run as a directory: import the package from its parent folder
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(here)] + [p for p in sys.path
                                             if os.path.abspath(p or ".") != here]

from tfdist_launch.cli import main  # noqa: E402

sys.exit(main())
