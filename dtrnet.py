"""dtrnet: filled by its paper issue."""
