"""What the three domains' demos share: reward curves (``curves``) and statistics over seeds (``seed_stats``).

These modules serve only the demos, so they live beside them rather than in the core's run
loop (``grouprl/trainer/``). This package is not a domain: every domain may import it, and it
imports the core only, never a domain (``tests/core/test_layering.py``).
"""
