"""Views of a run: the status text today, live views and metrics beside it."""
