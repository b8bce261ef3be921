"""``python -m service diagnose``: read a window of metrics, say where the tail latency went."""
