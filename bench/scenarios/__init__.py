"""One module per scenario; each verifies its result before it reports a figure."""
