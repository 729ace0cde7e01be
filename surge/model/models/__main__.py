"""`python -m surge.model.models`: the README's table of supported architectures, from the registry."""
import sys

from surge.model.models.registry import architectures_markdown

sys.stdout.write(architectures_markdown())
