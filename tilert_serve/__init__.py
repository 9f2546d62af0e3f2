"""tilert_serve: everything on the serving path of tilert-pd (see DESIGN.md for the request path)."""

__version__ = "0.1.0"
