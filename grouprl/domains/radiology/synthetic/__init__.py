"""Synthetic chest X-ray studies (``cxr``) and RadVLM-style tasks built on them (``tasks``), offline."""
