"""Shared test settings: no network, no hub."""
