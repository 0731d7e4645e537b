"""Widgets of the chat and race screens (each in its own module)."""
