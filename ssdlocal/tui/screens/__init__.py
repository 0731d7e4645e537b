"""Screens: chat, race, and the modal dialogs (error, help)."""
