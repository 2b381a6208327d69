"""`python -m experiments.review`: the review of experiments/review/runs.py."""

import sys

from experiments.review.runs import main

sys.exit(main())
