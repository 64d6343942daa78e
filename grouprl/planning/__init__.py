"""Planning a run before it starts: the memory of a step from the configs alone (``grouprl plan``).

``memory`` holds the formulas (pure functions), ``model_shape`` a model's numbers from its config
on the meta device, ``plan`` the settings of a run and its per-device plan, ``live_bytes`` the
live-tensor measurements the formulas are checked against, ``command`` the CLI command.
"""
