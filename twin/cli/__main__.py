"""`python -m twin.cli`: the `twin` command."""

from twin.cli.main import app

app()
