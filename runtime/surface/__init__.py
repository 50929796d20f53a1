"""The Quart-Trio A2A surface: JSON-RPC dispatch, SSE streams, the agent card, /livez and /healthz.

``create_app`` (see ``runtime.surface.app`` for what the server passes) builds the app that
``hypercorn.trio.serve`` runs.
"""

from runtime.surface.app import CARD_PATH, SurfaceConfig, create_app
from runtime.surface.card import CardFor
from runtime.surface.health import Health, ModelCatalog, Readiness
from runtime.surface.streams import KEEPALIVE

__all__ = ["CARD_PATH", "KEEPALIVE", "CardFor", "Health", "ModelCatalog", "Readiness", "SurfaceConfig", "create_app"]
