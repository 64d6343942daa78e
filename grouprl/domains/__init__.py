"""Domain packages: the work of the seed systems, built on grouprl's core.

- ``radiology``: clinical rewards and the CheXpert-style labeler, the reward server
  with EditGRPO's and RadVLM-GRPO's protocols and its client, EditGRPO's post-rollout
  edits, CheXPO-v2's sample selection, report evaluation, synthetic chest X-rays and
  the report demos;
- ``diffusion``: Flow-GRPO, Flow-GRPO-Fast and GRPO-Guard for flow-matching image models;
- ``reasoning``: Guided-GRPO's synthetic arithmetic task, its rule verifier and demo;
- ``demos`` (not a domain): what the three demos share, reward curves and statistics over seeds.

The rule (enforced by ``tests/core/test_layering.py``): nothing outside this package
imports it, and no domain imports another (every domain may import ``demos``). A domain plugs its parts into the core's
registries by name when its ``grouprl.plugins`` entry point is loaded.
"""
