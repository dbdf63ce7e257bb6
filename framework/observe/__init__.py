"""Observability: metric sinks, MFU/HFU, per-domain evaluation, preflight, data-mixture ablations and plots."""
