"""`python -m spark_plugins.javacheck`: exit 0 when Spark can run here, else say why (exit 1).

Meant for `make test`: run it before the Spark tests so a missing Java 17 is a clear
message with install instructions, not a Py4J stack trace.
"""

from __future__ import annotations

import sys

from spark_plugins.session import spark_problem


def main() -> int:
    problem = spark_problem()
    if problem:
        print(f"pushgw spark: {problem}", file=sys.stderr)
        return 1
    print("pushgw spark: pyspark and Java 17+ found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
