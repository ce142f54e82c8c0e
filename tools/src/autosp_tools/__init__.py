"""AutoSP tools."""
