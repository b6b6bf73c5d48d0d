"""`python -m producer.cli`: the `producer` command."""

import sys

from producer.cli import main

sys.exit(main())
