"""pushgw: a privacy-preserving push gateway framework.

Plugins import from `gateway.api` only.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pushgw")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+source"
