"""Grafana dashboards for the metrics the agent serves, built as code.

`build.py` builds them with the grafana-foundation-sdk; the generated JSON
lives in `dashboards/` and ships with the package, so using a dashboard needs
neither the SDK nor Python. `provision.py` puts them, and the Prometheus data
source they query, into a running Grafana through its HTTP API.
"""
