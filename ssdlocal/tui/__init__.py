"""Textual TUI for `ssdlocal chat` and `ssdlocal race`.

Importing this package imports nothing heavy: Textual is loaded only by the app
modules, and `require_textual()` turns a missing install into an SSDLocalError with a
hint. The UI-free parts (core.py, race.py, testing.py) never import Textual.
"""

from __future__ import annotations

INSTALL_HINT = "install the TUI extra: pip install 'ssdlocal[tui]'"


def require_textual() -> None:
    """Raise SSDLocalError (with the install hint) when Textual is not installed."""
    from ssdlocal.core.errors import SSDLocalError

    try:
        import textual  # noqa: F401
    except ImportError:
        raise SSDLocalError("the chat and race screens need Textual, which is not installed", INSTALL_HINT) from None
