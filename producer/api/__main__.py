"""`python -m producer.api`: what `producer serve` runs."""

import sys

from producer.api.serve import main

sys.exit(main())
