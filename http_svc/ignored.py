"""The warning for request fields the server ignores (fields a request model does not
declare, `http_svc.protocol.ignored_fields`): one line per request that had some, naming them
and the route, at most one line per `interval_s` so that a client sending the same extra field
on every request does not flood the log; the lines held back are counted in the next one."""

import logging
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("http_svc.ignored")

INTERVAL_S = 10.0


class IgnoredFieldsWarning:
    def __init__(self, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self._held = 0

    def __call__(self, route: str, fields: Sequence[str]) -> bool:
        """Logs the warning unless one was logged less than `interval_s` ago; whether it did."""
        if not fields:
            return False
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            self._held += 1
            return False
        held = (f" ({self._held} more requests with ignored fields since the last warning)"
                if self._held else "")
        log.warning("%s: ignored unknown field%s %s%s", route, "s" if len(fields) > 1 else "",
                    ", ".join(fields), held)
        self._last, self._held = now, 0
        return True


warn_ignored = IgnoredFieldsWarning()
