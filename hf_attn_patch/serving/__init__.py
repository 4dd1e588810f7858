"""An OpenAI-compatible server over the Engine (the `serve` extra): the app, its routes, the engine thread, the
request protocol and tool calls, each its own module. Importing this package needs fastapi."""

from .app import create_app, make_server, serve

__all__ = ["create_app", "make_server", "serve"]
