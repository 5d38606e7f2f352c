"""conddepth: filled by its paper issue."""
