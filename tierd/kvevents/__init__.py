"""KV-cache events for routers, in the engines' own wire format (docs/events.md)."""
