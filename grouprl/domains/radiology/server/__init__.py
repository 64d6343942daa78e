"""The reward server (``grouprl serve rewards``) and its client.

``app``: the FastAPI application with EditGRPO's ``/predict``, ``/analyze`` and
``/extract`` and grouprl's ``/score``; ``radvlm``: RadVLM-GRPO's reward-worker
endpoints; ``client``: the client the trainer uses for ``worker.reward.reward_server``.
"""
