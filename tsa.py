"""tsa: filled by its paper issue."""
