"""Getting a SparkSession: embedded local mode by default, the submitter's cluster otherwise.

- `pushgw spark run` without `--master` starts an embedded `local[*]` Spark (no cluster):
  small shuffle partition count, no web UI, WARN logging, a console progress bar for
  stages longer than half a second, and a driver heap sized from the machine's memory.
- Under `spark-submit` (the entry scripts in `spark_plugins/submit/`) the master, memory
  and everything else come from `spark-submit`; only job-level SQL settings are applied.

`java_problem()` says why Spark cannot start (no Java, or Java older than 17), in words
an operator can act on; `python -m spark_plugins.javacheck` prints it for `make test`.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

MIN_JAVA = 17
JAVA_HELP = (
    "Spark needs Java 17 or newer. Install it (Debian/Ubuntu: `apt-get install "
    "openjdk-17-jre-headless`; macOS: `brew install openjdk@17`; or any Temurin 17+ "
    "build from https://adoptium.net) and put `java` on PATH or set JAVA_HOME."
)
NO_PASSWD_ENTRY = (
    "user id {uid} has no entry in the user database (/etc/passwd), and Spark's Hadoop "
    "file system code refuses to run without a user name: run as a user that has one, or "
    "give it one with nss_wrapper (LD_PRELOAD=libnss_wrapper.so, NSS_WRAPPER_PASSWD, "
    "NSS_WRAPPER_GROUP); HADOOP_USER_NAME and SPARK_USER are not enough"
)
PYSPARK_HELP = (
    "pyspark is not installed: install the Spark extra with `pip install 'pushgw[spark]'`."
)

# Job-level SQL settings, applied to every session (local or submitted).
SQL_CONF = {
    "spark.sql.session.timeZone": "UTC",
    # Let adaptive execution coalesce the partitions of a cached result, which Spark 4
    # does not do by default. The jobs cache small aggregates and then write and collect
    # them; with a cluster's default of 200 shuffle partitions, every action on them ran
    # 200 tasks. Measured at 200 partitions: 1.2-1.4x faster over 1M receipts, 2-3.7x
    # on a few hundred; no change at local mode's 8.
    "spark.sql.optimizer.canChangeCachedPlanOutputPartitioning": "true",
    # Timestamps in the tables' Parquet files as UTC instants in microseconds, the
    # Parquet standard's type (Spark's default is the legacy INT96), as the tables a job
    # writes from the driver with pyarrow have them (spark_plugins.output).
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    # Keep the input counts (an `Observation` on the read pass) when a job's shuffle
    # turns out empty: adaptive execution would replace the plan that ran with an empty
    # relation, and the observed metrics with it, so a directory of bad lines only (or,
    # for dead-tokens, of receipts without a token hash) reported no line, read or bad.
    "spark.sql.adaptive.optimizer.excludedRules": (
        "org.apache.spark.sql.execution.adaptive.AQEPropagateEmptyRelation"
    ),
}

# Settings a job tunes for its own aggregations, for the length of the job (`sql_conf`):
# how many groups an "object" aggregate (sketches, lists) keeps in a hash map before it
# sorts its input instead, and (Spark 4.3+) whether to skip the partial aggregation
# before a shuffle (it saves nothing when nearly every row of a task is its own group).
OBJECT_HASH_GROUPS = "spark.sql.objectHashAggregate.sortBased.fallbackThreshold"
BYPASS_PARTIAL_AGGREGATION = "spark.sql.execution.bypassPartialAggregation"


def _java_binary() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home:
        candidate = os.path.join(home, "bin", "java")
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("java")


def java_version(java: str) -> int | None:
    """The major version of `java` (8 for 1.8), or None when it cannot be told."""
    try:
        proc = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', proc.stderr + proc.stdout)
    if not match:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2):  # "1.8.0_392"
        major = int(match.group(2))
    return major


def java_problem() -> str | None:
    """None when a usable Java (17+) is found, else what is wrong and how to fix it."""
    java = _java_binary()
    if java is None:
        return f"Java was not found. {JAVA_HELP}"
    major = java_version(java)
    if major is None:
        return f"could not run `{java} -version`. {JAVA_HELP}"
    if major < MIN_JAVA:
        return f"{java} is Java {major}. {JAVA_HELP}"
    return None


def pyspark_problem() -> str | None:
    """None when pyspark can be imported, else the install hint."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return PYSPARK_HELP
    return None


def user_problem() -> str | None:
    """None when this process's user id has a passwd entry, else what to do.

    Hadoop's login (run by every Spark file read or write) asks the JVM for the user's
    name from the passwd entry and fails with "Invalid UID" without one: a container run
    under an arbitrary user id (OpenShift, `runAsUser`) hits this.
    """
    try:
        pwd.getpwuid(os.getuid())
    except KeyError:
        return NO_PASSWD_ENTRY.format(uid=os.getuid())
    return None


def temp_dir_problem() -> str | None:
    """None when a temporary directory is writable (pyspark and the JVM need one)."""
    try:
        tempfile.gettempdir()
    except OSError as exc:  # tempfile tried TMPDIR, TEMP, TMP, /tmp, /var/tmp, /usr/tmp, "."
        reason = exc.strerror or type(exc).__name__
        return f"no writable temporary directory ({reason}): set TMPDIR to one"
    return None


def spark_problem() -> str | None:
    """Why a Spark job cannot run here (pyspark or Java missing, or an environment the
    driver JVM cannot start in: no passwd entry, no temporary directory), or None."""
    return pyspark_problem() or java_problem() or user_problem() or temp_dir_problem()


def under_spark_submit() -> bool:
    """Whether this Python process was started by `spark-submit` (the JVM is already up)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def default_driver_memory() -> str:
    """A third of physical memory, between 1 and 16 GiB (8g on a 24 GiB machine)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return "2g"
    gib = max(1, min(16, total // (3 * 1024**3)))
    return f"{gib}g"


def local_conf(cores: str = "*") -> dict[str, str]:
    """The embedded local-mode defaults."""
    return {
        "spark.master": f"local[{cores}]",
        "spark.driver.memory": default_driver_memory(),
        "spark.sql.shuffle.partitions": "8",
        "spark.default.parallelism": "8",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "true",
        "spark.sql.adaptive.enabled": "true",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.driver.host": "127.0.0.1",
        "spark.sql.warehouse.dir": os.path.join(tempfile.gettempdir(), "pushgw-spark-warehouse"),
    }


def _utf8_jvm_locale() -> None:
    """Have the JVM that pyspark starts encode file names in UTF-8 under LC_ALL=C.

    Java 17 encodes file names in the locale's charset (`sun.jnu.encoding`, which no
    `-D` option overrides): ASCII under LC_ALL=C or POSIX, where a receipts or output
    path with a non-ASCII letter was "Path does not exist" to Spark while Python (in
    UTF-8 mode there, PEP 540) found it. Python hands its children C.UTF-8 for LC_CTYPE
    (PEP 538) but not when LC_ALL is set; the JVM inherits this environment, so LC_ALL
    gets the same treatment. Other locales are left as the operator set them.
    """
    if os.environ.get("LC_ALL") in ("C", "POSIX"):
        os.environ["LC_ALL"] = "C.UTF-8"


DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"


def driver_java_options(conf: Mapping[str, str]) -> str:
    """The driver JVM's options: Python's temporary directory, then the operator's own.

    Java ignores TMPDIR and writes into /tmp (Spark's scratch and block directories, the
    native libraries of snappy and lz4), so on a read-only root file system a TMPDIR that
    Python honours did not reach the JVM. A `-Djava.io.tmpdir` of the operator's comes
    later on the command line and wins.
    """
    path = tempfile.gettempdir().replace("\\", "\\\\").replace('"', '\\"')
    own = f'"-Djava.io.tmpdir={path}"'  # quoted: Spark splits the options at spaces
    theirs = conf.get(DRIVER_JAVA_OPTIONS, "").strip()
    return f"{own} {theirs}" if theirs else own


def get_session(
    master: str | None = None,
    *,
    app_name: str = "pushgw",
    conf: dict[str, str] | None = None,
) -> SparkSession:
    """A SparkSession for running jobs.

    `master=None` means: the master `spark-submit` gave us, or else embedded
    `local[*]`. An explicit `master` (`local[2]`, `spark://host:7077`, `yarn`...) is used
    as is; the local-mode defaults apply only when the master is `local...`.
    """
    import warnings

    from pyspark.sql import SparkSession

    # pyspark warns on every pandas conversion when pandas is newer than it knows.
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas")
    builder = SparkSession.builder.appName(app_name)
    settings: dict[str, str] = {}
    if master is None and not under_spark_submit():
        master = "local[*]"
    if master is not None:
        if master.startswith("local"):
            settings.update(local_conf())
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # no hostname lookup warning
        settings["spark.master"] = master
    settings.update(SQL_CONF)
    settings.update(conf or {})
    if not under_spark_submit():  # the JVM is ours to start (spark-submit's is up already)
        _utf8_jvm_locale()
        settings[DRIVER_JAVA_OPTIONS] = driver_java_options(settings)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    for key, value in SQL_CONF.items():
        spark.conf.set(key, value)
    return spark


@contextmanager
def sql_conf(spark: SparkSession, settings: Mapping[str, str]) -> Iterator[None]:
    """Apply SQL `settings` for one job, then put back what was there before.

    Several jobs share one session (`pushgw spark run JOB JOB`), so a setting tuned for
    one job's aggregation must not leak into the next. A key this Spark does not know is
    accepted and has no effect.
    """
    previous = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in previous.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)
