"""``python -m dsv4_ort.bench``: the benchmark suite without the ``dsv4-ort`` entry point."""

import sys

from .cli import main

sys.exit(main())
