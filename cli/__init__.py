"""The deltasync command line."""
