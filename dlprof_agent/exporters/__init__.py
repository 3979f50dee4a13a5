"""Exporters render the agent's snapshots; only this package imports prometheus_client."""
