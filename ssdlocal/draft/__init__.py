"""Draft side of speculation: proposers (n-gram, synchronous model, async SSD worker)."""
