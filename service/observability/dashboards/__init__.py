"""Grafana dashboards as code (issue 28): the four dashboards of ``deploy/grafana/``, built in Python with
Grafana's own builder library (``grafana-foundation-sdk``, its Grafana 11.6 schema).

Ops tooling, not the request path: nothing in the gateway imports this package, and the library is a
``dev``/``ops`` extra of ``pyproject.toml``. Regenerate the committed JSON with
``python -m service.observability.dashboards`` (``--check`` compares instead of writing).

- :mod:`.kit`: the shared pieces (datasource and label variables, panel builders, ids and refIds).
- :mod:`.service_board`, :mod:`.tenants_board`, :mod:`.workers_board`, :mod:`.hardware_board`: one
  dashboard each.
- :mod:`.catalog`: every dashboard by file name, built to JSON-ready dicts.
- :mod:`.queries`: every panel's PromQL read back from a dashboard's JSON, and made concrete (the
  dashboard's variables replaced by their defaults) for a PromQL parser or a Prometheus server.
"""
