"""tilert_serve: everything on the serving path of tilert-pd (docs/architecture.md: the request path)."""

__version__ = "0.1.0"
