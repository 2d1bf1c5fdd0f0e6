"""Command-line tools for minicaffe (run with `python -m minicaffe.tools.<name>`)."""
