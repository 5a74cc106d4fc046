"""The OpenAI-compatible HTTP API (FastAPI) over an ``AsyncEngine``: request bodies
(``protocol``), the app (``api_server``) and its Prometheus metrics (``metrics``)."""
