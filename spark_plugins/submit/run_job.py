"""spark-submit entry script: any jobs of any installed plugins, in order, in one session.

spark-submit [spark options] run_job.py JOB [JOB ...] --receipts DIR --out DIR \
    [--option NAME=VALUE | JOB:NAME=VALUE ...]
"""

import sys
from pathlib import Path

try:
    import spark_plugins  # noqa: F401
except ImportError:  # running from a source tree: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spark_plugins.runner import submit_main

if __name__ == "__main__":
    sys.exit(submit_main())
