"""systemd's readiness protocol (`Type=notify`, sd_notify(3)) for `pushgw serve`.

Under a unit with `Type=notify`, systemd sets `$NOTIFY_SOCKET` to an AF_UNIX datagram
socket (a path, or a name in the abstract namespace when it starts with `@`) and
waits for a datagram saying `READY=1` before `systemctl start` returns and the units
ordered after the gateway start. `pushgw serve` sends it once every process listens and
serves, `STOPPING=1` when told to stop, and a `STATUS=` line with each. See
docs/systemd.md.

Written by hand, not taken from a library: the protocol is one datagram of
`KEY=value` lines (documented as stable, and meant to be reimplemented), while the
bindings (python-systemd) need libsystemd and a C compiler at install time.
"""

from __future__ import annotations

import contextlib
import os
import socket

NOTIFY_ENV = "NOTIFY_SOCKET"


class Notifier:
    """Sends state changes to systemd; does nothing when not started by it (no socket)."""

    def __init__(self, address: str | None) -> None:
        self.address = address or None
        self.warned = False

    @classmethod
    def from_environment(cls) -> Notifier:
        """The notifier of `$NOTIFY_SOCKET`, taken out of the environment (as sd_notify's
        `unset_environment`) so that no child process (a worker, the simulators, a
        plugin's subprocess) notifies in the gateway's name: systemd would refuse it
        (`NotifyAccess=main`), or take a worker's readiness for the gateway's."""
        return cls(os.environ.pop(NOTIFY_ENV, None))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send `lines` (`READY=1`, `STATUS=...`) as one datagram; whether it was sent.

        A failure (the socket gone, an address of a kind not spoken here) is one warning
        line on stderr, once, never an exception: systemd then stops a gateway that never
        said ready at its `TimeoutStartSec`, and the line says why.
        """
        if self.address is None:
            return False
        message = "\n".join(line.replace("\n", " ") for line in lines).encode()
        address = self.address
        if address.startswith("@"):  # the abstract namespace: a leading NUL byte
            address = "\0" + address[1:]
        try:
            if not address.startswith(("/", "\0")):
                # `vsock:CID:PORT` (systemd in a VM's host) is not spoken here
                raise OSError(f"{self.address}: not an AF_UNIX socket address")
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(message, address)
        except OSError as exc:
            if not self.warned:
                self.warned = True
                reason = exc.strerror or str(exc)
                line = f"pushgw: warning: cannot notify systemd (${NOTIFY_ENV}): {reason}\n"
                # os.write, not print(): this may run in a signal handler (STOPPING=1)
                # that interrupted a print() to stderr.
                with contextlib.suppress(OSError):
                    os.write(2, line.encode())
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def stopping(self, status: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")
