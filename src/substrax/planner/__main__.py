"""``python -m substrax.planner``: the planner's command line (:func:`substrax.planner.main`)."""

import sys

from substrax.planner._cli import main

sys.exit(main())
