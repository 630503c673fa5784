"""Scaffolding for tests, benchmarks, the demo and the documentation's figures, never imported by training:
tiny random-weight pipelines (:mod:`.zoo`) and config-only folders at real size (:mod:`.config_only`)."""
