"""CancelToken: one request to stop, made before or during the work it stops.

The thread that starts a generate call creates the token and passes it in; any other
thread may cancel it at any time, even before the call has begun (it then returns at
once). A token made with a parent is cancelled with it (an app quitting stops every
call made under it).
"""

from __future__ import annotations

import threading


class CancelToken:
    def __init__(self, parent: CancelToken | None = None) -> None:
        self._event = threading.Event()
        self._parent = parent

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set() or (self._parent is not None and self._parent.cancelled)
